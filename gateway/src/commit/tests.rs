//! The commit thread's answers when the disk fails under it: a change is
//! acknowledged only if a restart enforces it, and no acknowledged change
//! is lost to one that failed.

use std::path::Path;

use egress_policy::{PlatformDenies, Policy};

use super::*;

fn registry() -> Arc<Registry> {
    Arc::new(Registry::new(Arc::new(PlatformDenies::builtin())))
}

fn sandbox(r: &Registry, id: &str, addr: &str) -> Arc<Sandbox> {
    r.prepare(
        SandboxId::new(id),
        vec![addr.parse().expect("ip")],
        Policy::default(),
    )
}

/// The worker over what `dir` holds, as a start recovers it.
fn worker(dir: &Path) -> Worker {
    let registry = registry();
    let (journal, seq, _) = journal::recover(&registry, dir).expect("recover");
    Worker {
        registry,
        cache: None,
        state_dir: dir.to_owned(),
        journal,
        generation: Arc::new(AtomicU64::new(seq)),
        deleted: super::revisions::Deleted::default(),
        doubt: None,
        stuck: Arc::default(),
    }
}

fn job(change: Change) -> (JobBox, oneshot::Receiver<Outcome>) {
    let (reply, answer) = oneshot::channel();
    (Box::new(Job { change, reply }), answer)
}

/// Commits one change on its own: whether it was acknowledged.
fn commit(w: &mut Worker, change: Change) -> bool {
    let (job, mut answer) = job(change);
    match job.change {
        Change::Replace(_) => w.replace(*job),
        _ => w.commit(vec![job]),
    }
    answer.try_recv().expect("answered").is_ok()
}

/// Commits a put of sandbox `id` on `addr`: whether it was acknowledged.
fn put(w: &mut Worker, id: &str, addr: &str) -> bool {
    let s = sandbox(&w.registry, id, addr);
    commit(w, Change::Put(s))
}

/// The sandboxes a restart finds, and the last sequence number.
fn restarted(dir: &Path) -> (Vec<SandboxId>, u64) {
    let r = registry();
    let (_, seq, _) = journal::recover(&r, dir).expect("recover");
    (r.ids(), seq)
}

fn ids(names: &[&str]) -> Vec<SandboxId> {
    names.iter().map(|n| SandboxId::new(n)).collect()
}

/// A handle on the journal that reads but cannot write or cut.
fn read_only(dir: &Path) -> std::fs::File {
    std::fs::File::open(journal::path(dir)).expect("open")
}

fn writable(dir: &Path) -> std::fs::File {
    std::fs::OpenOptions::new()
        .read(true)
        .append(true)
        .open(journal::path(dir))
        .expect("open")
}

#[test]
fn a_resync_is_durable_once_its_snapshot_is_even_if_the_journal_is_not_emptied() {
    let dir = tempfile::tempdir().expect("dir");
    let mut w = worker(dir.path());
    assert!(put(&mut w, "a", "100.64.0.1"));
    // The snapshot (seq 2) is written; emptying the journal fails.
    w.journal.use_file(read_only(dir.path()));
    let b = sandbox(&w.registry, "b", "100.64.0.2");
    assert!(
        commit(&mut w, Change::Replace(vec![b])),
        "acknowledged: a restart enforces it"
    );
    assert_eq!(w.registry.ids(), ids(&["b"]));
    w.journal.use_file(writable(dir.path()));
    assert!(put(&mut w, "c", "100.64.0.3"));
    // Before, the resync answered 500 and rolled back, the push took seq 2,
    // and a restart skipped it under the snapshot's seq 2: c was lost.
    assert_eq!(restarted(dir.path()), (ids(&["b", "c"]), 3));
}

#[test]
fn a_failed_append_that_cannot_be_cut_back_stops_commits_until_a_restart() {
    let dir = tempfile::tempdir().expect("dir");
    let mut w = worker(dir.path());
    assert!(put(&mut w, "a", "100.64.0.1"));
    w.journal.use_file(read_only(dir.path()));
    assert!(!put(&mut w, "b", "100.64.0.2"), "not durable: refused");
    assert_eq!(w.registry.ids(), ids(&["a"]), "rolled back");
    // The disk takes writes again, but what the failed append left is not
    // known: nothing more is acknowledged before a restart.
    w.journal.use_file(writable(dir.path()));
    w.tell_if_stuck();
    assert!(w.stuck.load(Ordering::Acquire), "readiness is told");
    let c = sandbox(&w.registry, "c", "100.64.0.3");
    let (job, mut answer) = job(Change::Put(c));
    assert!(w.unless_in_doubt(job).is_none(), "refused");
    let refused = answer.try_recv().expect("answered");
    assert!(
        matches!(&refused, Err(NotApplied::Failed(why)) if why.contains("in doubt")),
        "{refused:?}"
    );
    assert_eq!(restarted(dir.path()), (ids(&["a"]), 1));
}

#[test]
fn a_resync_whose_snapshot_was_never_written_leaves_commits_open() {
    let dir = tempfile::tempdir().expect("dir");
    let mut w = worker(dir.path());
    assert!(put(&mut w, "a", "100.64.0.1"));
    // The temporary file cannot be made: the old state stays in place.
    let tmp = dir.path().join(format!(".{}.tmp", persist::SNAPSHOT_FILE));
    std::fs::create_dir(&tmp).expect("a directory in its way");
    let b = sandbox(&w.registry, "b", "100.64.0.2");
    assert!(!commit(&mut w, Change::Replace(vec![b])));
    assert!(w.in_doubt().is_none(), "the old snapshot is known to stand");
    std::fs::remove_dir(&tmp).expect("out of the way");
    assert!(put(&mut w, "c", "100.64.0.3"));
    assert_eq!(restarted(dir.path()), (ids(&["a", "c"]), 2));
}

/// A commit thread that does not take its changes (an fsync that does not
/// return) holds at most [`MAX_QUEUED`] of them: the next is refused at once,
/// and the seal still waits for a place rather than being refused.
#[tokio::test]
async fn a_stalled_commit_thread_holds_a_bounded_queue() {
    let (jobs, mut rx) = mpsc::channel(MAX_QUEUED);
    let committer = Committer {
        jobs,
        generation: Arc::default(),
        stuck: Arc::default(),
    };
    let waiting: Vec<_> = (0..MAX_QUEUED)
        .map(|i| {
            let c = committer.clone();
            tokio::spawn(async move {
                c.submit(Change::Delete(SandboxId::new(&format!("s{i}")), None))
                    .await
            })
        })
        .collect();
    while committer.jobs.capacity() > 0 {
        tokio::task::yield_now().await;
    }
    let next = committer
        .submit(Change::Delete(SandboxId::new("one-more"), None))
        .await;
    assert!(matches!(next, Err(NotApplied::Busy)), "{next:?}");
    // The seal waits for a place: one taken off, it goes in.
    let sealing = tokio::spawn({
        let c = committer.clone();
        async move { c.seal(Duration::from_secs(30)).await }
    });
    tokio::task::yield_now().await;
    assert!(!sealing.is_finished());
    let first = rx.recv().await.expect("a job");
    drop(first);
    let seal = loop {
        let job = rx.recv().await.expect("the seal comes");
        if matches!(job.change, Change::Seal) {
            break job;
        }
    };
    let _ = seal.reply.send(Ok(0));
    sealing.await.expect("ran").expect("sealed");
    drop(waiting);
}

/// A commit thread stuck (on a stalled disk) has not sealed: the seal says
/// so within its time instead of waiting for good, and a handover is not
/// made over a thread that may still write.
#[tokio::test]
async fn a_seal_the_commit_thread_never_takes_fails_in_time() {
    let (jobs, _stuck) = mpsc::channel(MAX_QUEUED);
    let committer = Committer {
        jobs,
        generation: Arc::default(),
        stuck: Arc::default(),
    };
    let sealed = tokio::time::timeout(
        Duration::from_secs(10),
        committer.seal(Duration::from_millis(200)),
    )
    .await
    .expect("the seal gives up within its time");
    let why = sealed.expect_err("not sealed");
    assert!(why.contains("did not seal"), "{why}");
}

/// A sandbox's DNS evidence goes once its removal is durable, before the
/// next change applies: a put of its id after its delete waits for the next
/// batch, so a sandbox registered again is not judged on the removed one's
/// evidence nor loses its own afterwards. A removal rolled back keeps it; a
/// resync that drops the sandbox forgets it too.
#[test]
fn a_removed_sandboxs_evidence_goes_once_the_removal_is_durable() {
    let dir = tempfile::tempdir().expect("dir");
    let mut w = worker(dir.path());
    let cache = Arc::new(dns_attrib::AttributionCache::new(
        dns_attrib::CacheConfig::default(),
        dns_attrib::ManualClock::new(),
    ));
    w.cache = Some(cache.clone());
    let (x, ip) = (SandboxId::new("x"), "203.0.113.7".parse().expect("ip"));
    let evidence = || {
        let name = egress_policy::Hostname::parse("api.test").expect("name");
        assert!(cache.restore(&x, ip, &[(name, Duration::from_secs(60))]));
    };
    let names = || cache.names_for(&x, ip).names().len();
    assert!(put(&mut w, "x", "100.64.0.2"));
    evidence();
    // The journal write fails: the delete is rolled back, evidence and all.
    w.journal.use_file(read_only(dir.path()));
    assert!(!commit(&mut w, Change::Delete(x.clone(), None)));
    assert!(w.registry.get(&x).is_some());
    assert_eq!(names(), 1, "a rolled-back delete forgot the evidence");
    w.journal.use_file(writable(dir.path()));
    assert!(commit(&mut w, Change::Delete(x.clone(), None)));
    assert_eq!(names(), 0, "the removed sandbox's evidence was left");
    // A put of the id waits for the delete's batch to end.
    let (delete, _) = job(Change::Delete(x.clone(), None));
    let (again, _) = job(Change::Put(sandbox(&w.registry, "x", "100.64.0.2")));
    let (other, _) = job(Change::Put(sandbox(&w.registry, "y", "100.64.0.3")));
    assert!(deleted_in(std::slice::from_ref(&delete), &again));
    assert!(!deleted_in(std::slice::from_ref(&delete), &other));
    assert!(put(&mut w, "x", "100.64.0.2"));
    evidence();
    let other = sandbox(&w.registry, "y", "100.64.0.3");
    assert!(commit(&mut w, Change::Replace(vec![other])));
    assert_eq!(names(), 0, "a resync left a dropped sandbox's evidence");
    // A put rolled back takes with it what its sandbox was answered while
    // its batch was being written (here: before, which is the same).
    evidence();
    w.journal.use_file(read_only(dir.path()));
    assert!(!put(&mut w, "x", "100.64.0.2"));
    assert!(w.registry.get(&x).is_none());
    assert_eq!(names(), 0, "a rolled-back put left its evidence");
}

/// A commit thread that ends in a panic is told as stuck (every change
/// would be refused); one that returns is not.
#[test]
fn a_commit_thread_that_panics_is_told_as_stuck() {
    for panics in [false, true] {
        let stuck = Arc::new(AtomicBool::new(false));
        let died = Died(stuck.clone());
        let _ = std::thread::spawn(move || {
            let _died = died;
            assert!(!panics, "a bug in the commit thread");
        })
        .join();
        assert_eq!(stuck.load(Ordering::Acquire), panics);
    }
}

/// A batch whose append fails is refused whole: each answer was found on
/// the state rolled back. A second delete of a sandbox in the batch saw it
/// gone; answered "already gone" (404), a controller counts the delete as
/// done while the sandbox is still registered.
#[test]
fn a_batch_rolled_back_refuses_every_answer_it_found() {
    let dir = tempfile::tempdir().expect("dir");
    let mut w = worker(dir.path());
    assert!(put(&mut w, "a", "100.64.0.1"));
    w.journal.use_file(read_only(dir.path()));
    let a = SandboxId::new("a");
    let (first, mut first_answer) = job(Change::Delete(a.clone(), None));
    let (second, mut second_answer) = job(Change::Delete(a.clone(), None));
    w.commit(vec![first, second]);
    assert!(w.registry.get(&a).is_some(), "rolled back");
    for answer in [first_answer.try_recv(), second_answer.try_recv()] {
        let answer = answer.expect("answered");
        assert!(
            matches!(&answer, Err(NotApplied::Failed(why)) if why.contains("not applied")),
            "{answer:?}"
        );
    }
}

/// A compaction that fails (here its temporary file cannot be made) is
/// tried again once the journal has grown by what made it due (4 MiB
/// here), not after every batch: each try writes the whole state. Once it
/// can be written, it is.
#[test]
fn a_failed_compaction_waits_for_the_journal_to_grow_again() {
    let dir = tempfile::tempdir().expect("dir");
    let mut w = worker(dir.path());
    let entries: Vec<String> = (0..3_000)
        .map(|i| format!(r#"{{"domain": "h{i:05}.example.test"}}"#))
        .collect();
    let text = format!(r#"{{"allow": [{}]}}"#, entries.join(","));
    let big = w.registry.prepare(
        SandboxId::new("a"),
        vec!["100.64.0.1".parse().expect("ip")],
        Policy::from_json(&text).expect("policy"),
    );
    let tmp = dir.path().join(format!(".{}.tmp", persist::SNAPSHOT_FILE));
    std::fs::create_dir(&tmp).expect("a directory in its way");
    assert!(commit(&mut w, Change::Put(big.clone())));
    let step = w.journal.bytes();
    // Past twice the 4 MiB before the first try: doubling would wait for
    // twice that again.
    while w.journal.bytes() < 8 << 20 {
        assert!(commit(&mut w, Change::Put(big.clone())));
    }
    let failed_at = w.journal.bytes();
    assert!(w.journal.compaction_due());
    w.compact_if_due();
    let again_at = loop {
        assert!(commit(&mut w, Change::Put(big.clone())));
        if w.journal.compaction_due() {
            break w.journal.bytes();
        }
    };
    assert!(
        (failed_at + (4 << 20)..=failed_at + (4 << 20) + step).contains(&again_at),
        "a compaction that failed at {failed_at} bytes was due again at {again_at}, not 4 MiB later"
    );
    std::fs::remove_dir(&tmp).expect("out of the way");
    w.compact_if_due();
    assert_eq!(w.journal.bytes(), 0, "compacted");
    let seq = w.generation.load(Ordering::Acquire);
    assert_eq!(restarted(dir.path()), (ids(&["a"]), seq));
}

/// A rollback puts back the state from before its change; an allow entry
/// that lapsed meanwhile (the lapse watch compiled it away between the
/// checkpoint and the failed write) stays out of force.
#[test]
fn a_rollback_does_not_bring_a_lapsed_allow_back() {
    let dir = tempfile::tempdir().expect("dir");
    let mut w = worker(dir.path());
    let soon = (time::OffsetDateTime::now_utc() + time::Duration::milliseconds(300))
        .format(&time::format_description::well_known::Rfc3339)
        .expect("format");
    let text = format!(r#"{{"allow": [{{"ip": "203.0.113.7", "until": "{soon}"}}]}}"#);
    let a = w.registry.prepare(
        SandboxId::new("a"),
        vec!["100.64.0.1".parse().expect("ip")],
        Policy::from_json(&text).expect("policy"),
    );
    assert!(commit(&mut w, Change::Put(a)));
    let before = w.registry.checkpoint();
    std::thread::sleep(Duration::from_millis(400));
    assert_eq!(
        w.registry.recompile_lapsed(time::OffsetDateTime::now_utc()),
        1
    );
    w.rolled_back(before);
    let a = w.registry.get(&SandboxId::new("a")).expect("a");
    assert!(
        a.policy.next_expiry().is_none(),
        "the lapsed allow is in force again"
    );
}

/// A shadow is compiled by its request: the commit thread takes it as it
/// is, unless the sandbox's credentials changed since it was compiled
/// (their hosts are compiled into a policy), and then compiles it again.
#[test]
fn a_shadow_compiled_by_its_request_is_compiled_again_only_for_new_credentials() {
    let dir = tempfile::tempdir().expect("dir");
    let mut w = worker(dir.path());
    assert!(put(&mut w, "a", "100.64.0.1"));
    let a = SandboxId::new("a");
    let doc = || crate::shadow::ShadowDoc {
        policy: Policy::from_json(r#"{"default": "allow"}"#).expect("policy"),
        since: "2026-12-06T00:00:00Z".into(),
        policy_changed: None,
    };
    let registry = w.registry.clone();
    let candidate = |credentials: Vec<crate::credentials::Credential>| {
        let shadow = Arc::new(registry.compile_shadow(doc(), &credentials));
        (
            shadow.clone(),
            Box::new(Candidate {
                shadow,
                credentials,
            }),
        )
    };
    let shadow_of = |w: &Worker| {
        w.registry
            .get(&a)
            .and_then(|s| s.shadow.clone())
            .expect("a shadow")
    };
    let (compiled, c) = candidate(Vec::new());
    assert!(commit(&mut w, Change::Shadow(a.clone(), Some(c))));
    assert!(Arc::ptr_eq(&shadow_of(&w), &compiled), "compiled again");
    let other: Vec<crate::credentials::Credential> = serde_json::from_str(
        r#"[{"name": "gh", "placeholder": "EGRESS_PH_GH", "hosts": ["api.github.test"],
             "inject": {"header": "authorization", "format": "token {value}"},
             "source": {"env": "GH_TOKEN"}}]"#,
    )
    .expect("credentials");
    let (compiled, c) = candidate(other);
    assert!(commit(&mut w, Change::Shadow(a.clone(), Some(c))));
    let applied = shadow_of(&w);
    assert!(
        !Arc::ptr_eq(&applied, &compiled),
        "compiled for credentials the sandbox lacks"
    );
    assert!(
        !applied.policy.has_request_rules(),
        "compiled with the credentials it has"
    );
    assert!(compiled.policy.has_request_rules());
}

/// A push of `id` on `addr` under a policy of `default` that names
/// `revision`: what the commit thread answered.
fn put_at(w: &mut Worker, id: &str, (default, revision): (&str, Option<u64>)) -> Outcome {
    let policy = Policy::from_json(&format!(r#"{{"default": "{default}"}}"#)).expect("policy");
    let extras = crate::registry::Extras {
        revision,
        ..Default::default()
    };
    let s = w.registry.prepare_with(
        SandboxId::new(id),
        vec!["100.64.0.2".parse().expect("ip")],
        policy,
        extras,
    );
    answer(w, Change::Put(s))
}

fn answer(w: &mut Worker, change: Change) -> Outcome {
    let (job, mut answer) = job(change);
    match job.change {
        Change::Replace(_) => w.replace(*job),
        _ => w.commit(vec![job]),
    }
    answer.try_recv().expect("answered")
}

fn default_of(w: &Worker, id: &str) -> Option<String> {
    let s = w.registry.get(&SandboxId::new(id))?;
    Some(format!("{:?}", s.policy.policy().default))
}

/// A push or delete that names a revision below the one held is refused,
/// nothing changed: a controller's push held up on its way must not put
/// back a policy the sandbox no longer has, nor register again a sandbox
/// deleted since. The same revision again, or none, applies; a resync is
/// the writer's whole view, whatever revisions it names; the state
/// directory keeps none.
#[test]
fn a_change_below_the_revision_held_is_refused() {
    let dir = tempfile::tempdir().expect("dir");
    let mut w = worker(dir.path());
    let stale = |o: Outcome| match o {
        Err(NotApplied::Stale(s)) => (s.held, s.named),
        other => panic!("not refused as stale: {other:?}"),
    };
    assert!(put_at(&mut w, "x", ("deny", Some(5))).is_ok());
    assert_eq!(stale(put_at(&mut w, "x", ("allow", Some(4)))), (5, 4));
    assert_eq!(
        default_of(&w, "x").as_deref(),
        Some("Deny"),
        "the older push applied"
    );
    assert!(
        put_at(&mut w, "x", ("deny", Some(5))).is_ok(),
        "the same push again"
    );
    assert!(
        put_at(&mut w, "x", ("deny", None)).is_ok(),
        "a push naming none"
    );
    assert!(put_at(&mut w, "x", ("deny", Some(6))).is_ok());
    // A delete below it is refused too; at or above, it deletes.
    let delete = |r| Change::Delete(SandboxId::new("x"), Some(r));
    assert_eq!(stale(answer(&mut w, delete(5))), (6, 5));
    assert!(default_of(&w, "x").is_some());
    assert!(answer(&mut w, delete(7)).is_ok());
    // Deleted at 7: a push below it does not register it again.
    assert_eq!(stale(put_at(&mut w, "x", ("allow", Some(6)))), (7, 6));
    assert_eq!(default_of(&w, "x"), None, "a deleted sandbox came back");
    assert!(put_at(&mut w, "x", ("allow", Some(8))).is_ok());
    // A delete of one not there keeps its revision all the same.
    assert!(matches!(
        answer(&mut w, Change::Delete(SandboxId::new("y"), Some(3))),
        Err(NotApplied::Missing)
    ));
    assert_eq!(stale(put_at(&mut w, "y", ("allow", Some(2)))), (3, 2));
    // The state directory keeps no revision (a build before them could
    // not read it back): after a restart a push is not checked until a
    // resync names the revisions again.
    assert_eq!(stale(put_at(&mut w, "x", ("deny", Some(7)))), (8, 7));
    drop(w);
    let mut w = worker(dir.path());
    assert!(put_at(&mut w, "x", ("deny", Some(7))).is_ok());
    // A resync sets what it names, lower or not.
    let policy = Policy::from_json(r#"{"default": "deny"}"#).expect("policy");
    let extras = crate::registry::Extras {
        revision: Some(1),
        ..Default::default()
    };
    let x = w.registry.prepare_with(
        SandboxId::new("x"),
        vec!["100.64.0.2".parse().expect("ip")],
        policy,
        extras,
    );
    assert!(answer(&mut w, Change::Replace(vec![x])).is_ok());
    assert!(put_at(&mut w, "x", ("deny", Some(2))).is_ok());
}
