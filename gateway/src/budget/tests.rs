use super::*;

fn budget(rpm: Option<u32>, bph: Option<u64>) -> Budget {
    budget_for("*", rpm, bph)
}

fn budget_for(destination: &str, rpm: Option<u32>, bph: Option<u64>) -> Budget {
    let mut entry = serde_json::json!({"destination": destination});
    if let Some(r) = rpm {
        entry["requests_per_minute"] = r.into();
    }
    if let Some(b) = bph {
        entry["bytes_per_hour"] = b.into();
    }
    serde_json::from_value(entry).expect("valid entry")
}

fn id(s: &str) -> SandboxId {
    SandboxId::parse(s).expect("id")
}

fn table(max: usize) -> BudgetTable {
    BudgetTable::new(max, Gauge::default(), Counter::default())
}

#[test]
fn a_minute_of_requests_is_the_burst_and_refills_continuously() {
    let t = table(64);
    let b = budget(Some(3), None);
    let a = id("sb-a");
    for _ in 0..3 {
        assert_eq!(t.request(&a, &b, 0, Millis(0)), Ok(()));
    }
    assert_eq!(t.request(&a, &b, 0, Millis(0)), Err(Over::Requests));
    // One request every 20 s at 3 a minute.
    assert_eq!(t.request(&a, &b, 0, Millis(19_999)), Err(Over::Requests));
    assert_eq!(t.request(&a, &b, 0, Millis(20_000)), Ok(()));
    assert_eq!(t.request(&a, &b, 0, Millis(20_000)), Err(Over::Requests));
    // Never more than the burst, however long the pause.
    let later = Millis(10 * HOUR_MS);
    for _ in 0..3 {
        assert_eq!(t.request(&a, &b, 0, later), Ok(()));
    }
    assert_eq!(t.request(&a, &b, 0, later), Err(Over::Requests));
}

#[test]
fn sandboxes_and_entries_have_buckets_of_their_own() {
    let t = table(64);
    let b = budget(Some(1), None);
    let api = budget_for("api.example.test", Some(1), None);
    let (a, other) = (id("sb-a"), id("sb-b"));
    assert_eq!(t.request(&a, &b, 0, Millis(0)), Ok(()));
    assert_eq!(t.request(&a, &b, 0, Millis(0)), Err(Over::Requests));
    assert_eq!(t.request(&other, &b, 0, Millis(0)), Ok(()));
    assert_eq!(t.request(&a, &api, 0, Millis(0)), Ok(()));
    assert_eq!(t.len(), 3);
}

/// An entry's state is its destination's, wherever the entry stands: a
/// push that puts another entry in front of it (so its index moves) keeps
/// its spent state, and the new entry starts full. Keyed by index, the
/// spent state went to the new entry and the old one started full.
#[test]
fn an_entry_keeps_its_state_when_a_push_moves_it() {
    let t = table(64);
    let a = id("sb-a");
    let api = budget_for("api.example.test", Some(1), None);
    let list = |entries: Vec<&Budget>| -> egress_policy::Budgets {
        serde_json::from_value(serde_json::to_value(entries).expect("json")).expect("budgets")
    };
    let name = |n: &str| egress_policy::Hostname::parse(n).expect("name");
    let (api_name, other_name) = (name("api.example.test"), name("other.example.test"));
    let first = list(vec![&api]);
    let (rule, entry) = first.find([&api_name]).expect("covered");
    assert_eq!(rule, 0);
    assert_eq!(t.request(&a, entry, 0, Millis(0)), Ok(()));
    let other = budget_for("other.example.test", Some(1), None);
    let pushed = list(vec![&other, &api]);
    let (rule, entry) = pushed.find([&api_name]).expect("covered");
    assert_eq!(rule, 1);
    assert_eq!(
        t.request(&a, entry, 0, Millis(0)),
        Err(Over::Requests),
        "still spent"
    );
    let (_, new) = pushed.find([&other_name]).expect("covered");
    assert_eq!(
        t.request(&a, new, 0, Millis(0)),
        Ok(()),
        "the new entry starts full"
    );
}

#[test]
fn a_crossing_flow_is_cut_and_drains_the_budget() {
    let t = table(64);
    let b = budget(None, Some(100 * 1024));
    let a = id("sb-a");
    let key = &a;
    assert_eq!(t.connect(key, &b, 500, Millis(0)), Ok(()));
    let mut moved = 500;
    while t.bytes(key, &b, 16 * 1024, Millis(0)).is_ok() {
        moved += 16 * 1024;
    }
    assert!(moved <= 100 * 1024, "never more than the budget: {moved}");
    assert!(
        moved > 100 * 1024 - 16 * 1024,
        "a chunk short at most: {moved}"
    );
    // Drained: not even a small chunk, and no new flow.
    assert_eq!(t.bytes(key, &b, 1, Millis(0)), Err(Over::Bytes));
    assert_eq!(t.connect(key, &b, 0, Millis(0)), Err(Over::Bytes));
    // 100 KiB an hour: 1 KiB (MIN_TO_START) is back after 36 s.
    assert_eq!(t.connect(key, &b, 0, Millis(35_999)), Err(Over::Bytes));
    assert_eq!(t.connect(key, &b, 0, Millis(36_000)), Ok(()));
}

#[test]
fn requests_charge_the_bytes_their_flow_moved_and_stop_when_none_are_left() {
    let t = table(64);
    let b = budget(Some(1000), Some(4096));
    let a = id("sb-a");
    assert_eq!(t.request(&a, &b, 1000, Millis(0)), Ok(()));
    t.charge(&a, &b, 3000, Millis(0));
    assert_eq!(t.request(&a, &b, 96, Millis(0)), Err(Over::Bytes));
    // 4 KiB an hour is a byte every ~879 ms.
    assert_eq!(t.request(&a, &b, 0, Millis(879)), Ok(()));
}

#[test]
fn a_full_table_forgets_only_refilled_states_else_refuses() {
    let t = table(SHARDS); // one state per shard
    let b = budget(Some(2), None);
    let sandboxes: Vec<SandboxId> = (0..4 * SHARDS).map(|i| id(&format!("sb-{i}"))).collect();
    // Spend a token of each: a shard's second sandbox finds its shard full
    // of a half-spent state, and is refused.
    let refused: Vec<&SandboxId> = sandboxes
        .iter()
        .filter(|s| t.request(s, &b, 0, Millis(0)) == Err(Over::NoState))
        .collect();
    assert!(!refused.is_empty(), "four times more sandboxes than room");
    assert!(t.len() <= SHARDS);
    assert_eq!(t.full.get(), refused.len() as u64);
    assert_eq!(t.gauge.get(), t.len() as i64);
    // Half a minute later the held states have refilled: one is forgotten
    // for a newcomer, who starts full, and then holds a spent state.
    let now = Millis(30_000);
    assert_eq!(t.request(refused[0], &b, 0, now), Ok(()));
    assert_eq!(t.request(refused[0], &b, 0, now), Ok(()));
    assert_eq!(t.request(refused[0], &b, 0, now), Err(Over::Requests));
    assert_eq!(t.len() as i64, t.gauge.get());
}

#[test]
fn a_forgotten_state_grants_nothing_it_had_not_refilled() {
    // Property: whatever is forgotten was full, so the requests any sandbox
    // gets in a minute never exceed burst + refill, with states churning.
    let t = table(SHARDS);
    let b = budget(Some(5), None);
    let sandboxes: Vec<SandboxId> = (0..3 * SHARDS).map(|i| id(&format!("sb-{i}"))).collect();
    let mut granted = vec![0u64; sandboxes.len()];
    for ms in (0..60_000u64).step_by(1_000) {
        for (i, s) in sandboxes.iter().enumerate() {
            if t.request(s, &b, 0, Millis(ms)) == Ok(()) {
                granted[i] += 1;
            }
        }
    }
    for (i, g) in granted.iter().enumerate() {
        assert!(*g <= 5 + 5, "sandbox {i} got {g} requests in a minute");
    }
}

#[test]
fn a_lowered_limit_caps_what_was_left() {
    let t = table(64);
    let a = id("sb-a");
    assert_eq!(
        t.request(&a, &budget(Some(100), None), 0, Millis(0)),
        Ok(())
    );
    let lower = budget(Some(1), None);
    assert_eq!(t.request(&a, &lower, 0, Millis(0)), Ok(()));
    assert_eq!(t.request(&a, &lower, 0, Millis(0)), Err(Over::Requests));
}

/// A takeover: the states a sandbox spent go to the successor's table,
/// their age carried (the clocks differ), for the sandboxes it has; a full
/// state is not sent, and a line that does not read back is dropped.
#[test]
fn spent_states_are_taken_over_by_a_successor() {
    let old = table(64);
    let b = budget(Some(3), Some(64 * 1024));
    let (a, gone, fresh) = (id("sb-a"), id("sb-gone"), id("sb-fresh"));
    for _ in 0..3 {
        assert_eq!(old.request(&a, &b, 0, Millis(1_000)), Ok(()));
        assert_eq!(old.request(&gone, &b, 0, Millis(1_000)), Ok(()));
    }
    // A state refilled by the handover is full: nothing to send.
    assert_eq!(old.request(&fresh, &b, 0, Millis(0)), Ok(()));
    // 20 s later: one of sb-a's three tokens is back.
    let spent = old.spent(Millis(21_000));
    let mut sent: Vec<&str> = spent.iter().map(|s| s.sandbox.as_str()).collect();
    sent.sort_unstable();
    assert_eq!(sent, ["sb-a", "sb-gone"]);
    let spent: Vec<Spent> = spent
        .into_iter()
        .filter(|s| s.sandbox == "sb-a")
        .chain(
            old.spent(Millis(21_000))
                .into_iter()
                .filter(|s| s.sandbox == "sb-gone"),
        )
        .collect();
    // The successor's clock starts anew.
    let new = table(64);
    let mut lines = spent.clone();
    lines.push(Spent {
        requests: Some(SpentBucket {
            units: u64::MAX,
            age_ms: 0,
            rate: 3,
            period: MINUTE_MS,
        }),
        ..spent[0].clone()
    });
    let taken = new.take_over(lines, Millis(500), |s| *s != gone);
    assert_eq!(
        taken, 1,
        "sb-a's; sb-gone is not this gateway's, the bad line is dropped"
    );
    // One token, as on the predecessor: not a fresh three.
    assert_eq!(new.request(&a, &b, 0, Millis(500)), Ok(()));
    assert_eq!(new.request(&a, &b, 0, Millis(500)), Err(Over::Requests));
}

/// A state saved before a stop and read after hours down is refilled for
/// all of them, although this process's clock reads less than that: a
/// budget spent before a cold restart is whole again after two hours down.
#[test]
fn a_state_taken_after_hours_down_is_refilled_for_all_of_them() {
    let new = table(64);
    let b = budget(Some(3), Some(64 * 1024));
    let a = id("sb-a");
    let spent = |units| SpentBucket {
        units,
        age_ms: 2 * 3_600_000,
        rate: 3,
        period: MINUTE_MS,
    };
    let line = Spent {
        sandbox: "sb-a".into(),
        destination: b.destination.clone(),
        requests: Some(spent(0)),
        bytes: None,
    };
    assert_eq!(new.take_over(vec![line], Millis(300), |_| true), 1);
    for _ in 0..3 {
        assert_eq!(new.request(&a, &b, 0, Millis(300)), Ok(()));
    }
    assert_eq!(new.request(&a, &b, 0, Millis(300)), Err(Over::Requests));
}

/// One sandbox spending on new destinations from push to push cannot take
/// the table: it holds at most its bound of states, and once the table is
/// seven eighths full no more than the reserve's, so another sandbox still
/// gets the state it needs. Without the bound, the first had the whole
/// table and the other was refused.
#[test]
fn one_sandbox_cannot_take_every_state() {
    let t = table(1024);
    let (a, b) = (id("sb-a"), id("sb-b"));
    let mut held = 0;
    for i in 0..1024 {
        let entry = budget_for(&format!("d{i}.attacker.test"), None, Some(1 << 20));
        if t.connect(&a, &entry, 1024, Millis(0)).is_ok() {
            held += 1;
        }
    }
    assert_eq!(held, MAX_STATES_PER_SANDBOX, "the first sandbox's bound");
    let entry = budget_for("api.example.test", None, Some(1 << 20));
    assert_eq!(t.connect(&b, &entry, 1024, Millis(0)), Ok(()));
    assert_eq!(t.len() as i64, t.gauge.get());
    assert_eq!(t.full.get(), (1024 - MAX_STATES_PER_SANDBOX) as u64);
}

/// Near full, a sandbox holding more than the reserve gets no new state,
/// one holding fewer does; a state forgotten to make room is no longer
/// counted against the sandbox that held it.
#[test]
fn near_full_only_sandboxes_holding_little_get_new_states() {
    let t = table(SHARDS * 8); // 128 states, 8 a shard
    let b = budget(Some(2), None);
    let many = id("sb-many");
    for i in 0..RESERVE_STATES + 1 {
        let entry = budget_for(&format!("d{i}.many.test"), Some(2), None);
        assert_eq!(t.request(&many, &entry, 0, Millis(0)), Ok(()));
    }
    // Sandboxes of a state each, until seven eighths are held.
    let mut n = 0;
    while t.len() < 112 {
        let _ = t.request(&id(&format!("sb-{n}")), &b, 0, Millis(0));
        n += 1;
        assert!(n < 10_000, "{} states", t.len());
    }
    // Past it, the sandbox holding more than the reserve gets none (in any
    // shard), and a newcomer does (in a shard with room).
    for i in 0..16 {
        let entry = budget_for(&format!("late{i}.many.test"), Some(2), None);
        assert_eq!(t.request(&many, &entry, 0, Millis(0)), Err(Over::NoState));
    }
    let newcomers = (0..16).filter(|i| {
        t.request(&id(&format!("new-{i}")), &b, 0, Millis(0))
            .is_ok()
    });
    assert!(newcomers.count() > 0, "no newcomer got a state");
    // Refilled, states are forgotten for newcomers, and counted so.
    let now = Millis(60_000);
    for i in 0..200 {
        let _ = t.request(&id(&format!("later-{i}")), &b, 0, now);
    }
    let held: usize = lock(&t.held).values().sum();
    assert_eq!(held, t.len(), "the counts follow the states");
}

/// Refilled states do not count against a sandbox's bound for good: past
/// it, they are forgotten (all at once) and the new state is made. An hour
/// later, a sandbox that held 128 spent states gets new ones.
#[test]
fn refilled_states_make_room_under_a_sandboxs_bound() {
    let t = table(1024);
    let a = id("sb-a");
    for i in 0..MAX_STATES_PER_SANDBOX {
        let entry = budget_for(&format!("d{i}.a.test"), None, Some(1 << 20));
        assert_eq!(t.connect(&a, &entry, 1024, Millis(0)), Ok(()));
    }
    let more = |i: usize, at: u64| {
        let entry = budget_for(&format!("later{i}.a.test"), None, Some(1 << 20));
        t.connect(&a, &entry, 1024, Millis(at))
    };
    assert_eq!(more(0, 0), Err(Over::NoState), "spent: the bound holds");
    for i in 1..10 {
        assert_eq!(more(i, HOUR_MS + 1), Ok(()), "an hour later, refilled");
    }
    assert_eq!(lock(&t.held).get(&a).copied(), Some(9));
    assert_eq!(t.len() as i64, t.gauge.get());
}

/// A table seven eighths full of refilled states is not near full: a
/// sandbox gets more than the reserve's 8 states.
#[test]
fn refilled_states_do_not_keep_the_table_near_full() {
    let t = table(SHARDS * 8); // 128 states
    let b = budget(Some(2), None);
    let mut n = 0;
    while t.len() < 112 {
        let _ = t.request(&id(&format!("sb-{n}")), &b, 0, Millis(0));
        n += 1;
        assert!(n < 10_000, "{} states", t.len());
    }
    let a = id("sb-a");
    for i in 0..10 {
        let entry = budget_for(&format!("d{i}.a.test"), Some(2), None);
        assert_eq!(
            t.request(&a, &entry, 0, Millis(HOUR_MS)),
            Ok(()),
            "entry {i}"
        );
    }
}

/// States taken over from a predecessor existed already: none is dropped
/// for a sandbox's bound (it would start full, a fresh budget).
#[test]
fn states_taken_over_are_not_held_to_a_sandboxs_bound() {
    let old = table(1024);
    let a = id("sb-a");
    for i in 0..200 {
        let entry = budget_for(&format!("d{i}.a.test"), None, Some(1 << 20));
        let held = old.with_bound((&a, &entry.destination), Millis(0), false, |s| {
            let limit = byte_limit(&entry).expect("a byte limit");
            assert!(s.bytes.take(limit, 1024, Millis(0)));
            Ok(())
        });
        assert_eq!(held, Ok(()));
    }
    let lines = old.spent(Millis(0));
    assert_eq!(lines.len(), 200);
    let new = table(1024);
    assert_eq!(new.take_over(lines, Millis(0), |_| true), 200);
}

/// Bytes charged after a request (its body, moved since) are recorded even
/// when the state was forgotten meanwhile and its sandbox holds more than a
/// bound allows: they have moved, and a state dropped would start full.
#[test]
fn bytes_charged_are_recorded_though_the_state_was_swept() {
    let t = table(SHARDS * 8); // 128 states
    let y = id("sb-y");
    let download = budget_for("dl.y.test", None, Some(1 << 20));
    // A request whose head moved nothing yet: the state is full, idle.
    assert_eq!(t.request(&y, &download, 0, Millis(0)), Ok(()));
    let at = Millis(70_000);
    for i in 0..RESERVE_STATES + 1 {
        let entry = budget_for(&format!("d{i}.y.test"), Some(2), None);
        assert_eq!(t.request(&y, &entry, 0, at), Ok(()));
    }
    // Others' states past seven eighths of the table by one (the sweep
    // below forgets one state, and the table must still be in its last
    // eighth after it), none in a shard already full: a full shard would
    // make room by forgetting one of y's (its states are the least recently
    // used), and y would then be within the reserve (the shards are keyed
    // at random).
    let per_shard = 128 / SHARDS;
    let shard_of = |sb: &SandboxId, d: &BudgetDestination| {
        (t.keys.hash_one((sb.clone(), d.clone())) as usize) & (SHARDS - 1)
    };
    let mut used = [0usize; SHARDS];
    used[shard_of(&y, &download.destination)] += 1;
    for i in 0..RESERVE_STATES + 1 {
        let entry = budget_for(&format!("d{i}.y.test"), Some(2), None);
        used[shard_of(&y, &entry.destination)] += 1;
    }
    let b = budget(Some(2), None);
    let mut n = 0;
    while t.len() < 113 {
        let other = id(&format!("sb-{n}"));
        let shard = shard_of(&other, &b.destination);
        if used[shard] < per_shard {
            assert_eq!(t.request(&other, &b, 0, at), Ok(()));
            used[shard] += 1;
        }
        n += 1;
        assert!(n < 10_000, "{} states", t.len());
    }
    // Past the reserve: refused, and the sweep forgets the idle full state.
    let more = budget_for("more.y.test", Some(2), None);
    assert_eq!(t.request(&y, &more, 0, at), Err(Over::NoState));
    assert_eq!(t.len(), 112, "the idle full state swept");
    // The body's bytes, charged now.
    t.charge(&y, &download, 1 << 20, Millis(70_001));
    let spent = t.spent(Millis(70_002));
    let dl = spent
        .iter()
        .find(|s| s.sandbox == "sb-y" && s.destination == download.destination);
    assert!(dl.is_some(), "the charge was dropped: {spent:?}");
}
