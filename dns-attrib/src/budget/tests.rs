use super::*;

fn id(s: &str) -> SandboxId {
    SandboxId::new(s)
}

fn name(s: &str) -> Name {
    Name::from_ascii(s).expect(s)
}

const LIMITS: BudgetLimits = BudgetLimits {
    qps: 10,
    new_names_per_minute: 6,
};

#[test]
fn queries_per_second_refill_on_the_clock() {
    let b = Budgets::new(64);
    let a = id("a");
    let t0 = Millis(1_000);
    for i in 0..10 {
        assert!(
            b.query(&a, LIMITS, t0).is_ok(),
            "query {i} within the burst"
        );
    }
    let over = b
        .query(&a, LIMITS, t0)
        .expect_err("the 11th in the same instant");
    assert_eq!(
        over,
        Crossing {
            over: Over::Queries,
            first: true
        }
    );
    let again = b.query(&a, LIMITS, t0).expect_err("still over");
    assert!(!again.first, "the crossing is reported once");
    // 10 per second: one token every 100 ms.
    assert!(b.query(&a, LIMITS, Millis(1_099)).is_err());
    assert!(b.query(&a, LIMITS, Millis(1_100)).is_ok());
    let crossed = b.query(&a, LIMITS, Millis(1_100)).expect_err("over again");
    assert!(
        !crossed.first,
        "a crossing within the minute is not reported"
    );
    // A minute after the last report, the next crossing is.
    assert!(b.query(&a, LIMITS, Millis(61_000)).is_ok());
    let crossed = (0..10).find_map(|_| b.query(&a, LIMITS, Millis(61_000)).err());
    assert!(crossed.expect("over at once").first, "reported again");
    // A long pause refills to the burst, never past it.
    let later = Millis(1_000_000);
    for _ in 0..10 {
        assert!(b.query(&a, LIMITS, later).is_ok());
    }
    assert!(b.query(&a, LIMITS, later).is_err());
}

#[test]
fn only_new_names_spend_the_name_budget() {
    let b = Budgets::new(64);
    let a = id("a");
    let now = Millis(0);
    for i in 0..6 {
        let n = name(&format!("c{i}.exfil.test."));
        assert!(b.name(&a, &n, LIMITS, now).is_ok(), "new name {i}");
    }
    let err = b
        .name(&a, &name("c6.exfil.test."), LIMITS, now)
        .expect_err("the seventh new name in a minute");
    assert_eq!(err.over, Over::NewNames);
    // Names asked before cost nothing, whatever their case.
    for _ in 0..100 {
        assert!(b.name(&a, &name("C0.Exfil.Test."), LIMITS, now).is_ok());
    }
    // 6 a minute: one every 10 s.
    assert!(b
        .name(&a, &name("c6.exfil.test."), LIMITS, Millis(9_999))
        .is_err());
    assert!(b
        .name(&a, &name("c6.exfil.test."), LIMITS, Millis(10_000))
        .is_ok());
}

#[test]
fn sandboxes_have_budgets_of_their_own() {
    let b = Budgets::new(64);
    let now = Millis(0);
    for i in 0..50 {
        let _ = b.query(&id("a"), LIMITS, now);
        let _ = b.name(&id("a"), &name(&format!("n{i}.test.")), LIMITS, now);
    }
    assert!(b.query(&id("a"), LIMITS, now).is_err());
    for i in 0..6 {
        assert!(b.query(&id("b"), LIMITS, now).is_ok());
        assert!(b
            .name(&id("b"), &name(&format!("n{i}.test.")), LIMITS, now)
            .is_ok());
    }
}

#[test]
fn the_table_is_bounded_and_forgets_the_idle() {
    let b = Budgets::new(32); // two per shard, and the margin
    let now = Millis(0);
    for _ in 0..10 {
        let _ = b.query(&id("busy"), LIMITS, now);
    }
    assert!(b.query(&id("busy"), LIMITS, now).is_err());
    for i in 0..10_000 {
        let _ = b.query(&id(&format!("s{i}")), LIMITS, now);
    }
    assert_eq!(
        b.len(),
        SHARDS * shard_room(32),
        "every shard full, no more"
    );
    // "busy" was evicted while idle: it starts over with a full bucket.
    assert!(b.query(&id("busy"), LIMITS, now).is_ok());
}

#[test]
fn the_seen_table_holds_recent_names_in_fixed_memory() {
    let b = Budgets::new(1);
    let a = id("a");
    let wide = BudgetLimits {
        qps: 10,
        new_names_per_minute: 1_000_000,
    };
    for i in 0..100_000 {
        assert!(b
            .name(&a, &name(&format!("n{i}.test.")), wide, Millis(0))
            .is_ok());
    }
    // The last few dozen are still known (each bucket keeps its four newest).
    let tight = BudgetLimits {
        qps: 10,
        new_names_per_minute: 1,
    };
    let _ = b.name(&a, &name("spend.test."), tight, Millis(0));
    let known = (99_950..100_000)
        .filter(|i| {
            b.name(&a, &name(&format!("n{i}.test.")), tight, Millis(0))
                .is_ok()
        })
        .count();
    assert!(known >= 45, "{known} of the last 50 names remembered");
}

#[test]
fn no_spent_budget_is_forgotten_while_the_table_has_room() {
    // Every sandbox the table is sized for spends its queries; however the
    // keyed hash spreads them over the shards, each keeps its empty bucket.
    for max in [16, 64, 1_000, 16_384] {
        let b = Budgets::new(max);
        let now = Millis(0);
        let spend = BudgetLimits {
            qps: 1,
            new_names_per_minute: 1,
        };
        for i in 0..max {
            assert!(b.query(&id(&format!("s{i}")), spend, now).is_ok());
        }
        let refilled = (0..max)
            .filter(|i| b.query(&id(&format!("s{i}")), spend, now).is_ok())
            .count();
        assert_eq!(refilled, 0, "of {max} sandboxes, spent budgets forgotten");
    }
}
