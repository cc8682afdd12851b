use super::*;
use crate::clock::ManualClock;

fn h(s: &str) -> Hostname {
    Hostname::parse(s).expect(s)
}

fn ip(s: &str) -> IpAddr {
    s.parse().expect(s)
}

fn attr(names: &[&str], addrs: &[&str], ttl: u32) -> Attribution {
    Attribution {
        names: names.iter().map(|n| h(n)).collect(),
        addrs: addrs.iter().map(|a| ip(a)).collect(),
        ttl,
    }
}

fn setup(config: CacheConfig) -> (Arc<ManualClock>, AttributionCache) {
    let clock = ManualClock::new();
    let cache = AttributionCache::new(config, clock.clone());
    (clock, cache)
}

fn live(cache: &AttributionCache, sb: &SandboxId, a: &str) -> Vec<String> {
    let mut v: Vec<String> = cache
        .names_for(sb, ip(a))
        .names()
        .iter()
        .map(ToString::to_string)
        .collect();
    v.sort();
    v
}

#[test]
fn expiry_follows_the_clamped_ttl() {
    let (clock, cache) = setup(CacheConfig::default());
    let sb = SandboxId::new("a");
    cache.record(&sb, &attr(&["api.test"], &["203.0.113.7"], 0));
    assert_eq!(
        live(&cache, &sb, "203.0.113.7"),
        ["api.test"],
        "TTL 0 still covers the next connection"
    );
    clock.advance(Duration::from_secs(29));
    assert_eq!(live(&cache, &sb, "203.0.113.7"), ["api.test"]);
    clock.advance(Duration::from_secs(1));
    assert!(matches!(
        cache.names_for(&sb, ip("203.0.113.7")),
        Lookup::Missing(AttributionGap::Expired)
    ));

    cache.record(&sb, &attr(&["big.test"], &["203.0.113.8"], u32::MAX));
    clock.advance(Duration::from_secs(24 * 3600 - 1));
    assert_eq!(live(&cache, &sb, "203.0.113.8"), ["big.test"]);
    clock.advance(Duration::from_secs(1));
    assert_eq!(
        cache.names_for(&sb, ip("203.0.113.8")).gap(),
        AttributionGap::Expired,
        "huge TTLs are clamped to 24 h"
    );
}

#[test]
fn an_ip_keeps_every_name_and_each_its_own_expiry() {
    let (clock, cache) = setup(CacheConfig::default());
    let sb = SandboxId::new("a");
    cache.record(&sb, &attr(&["a.test"], &["203.0.113.7"], 60));
    cache.record(&sb, &attr(&["b.test"], &["203.0.113.7"], 300));
    assert_eq!(live(&cache, &sb, "203.0.113.7"), ["a.test", "b.test"]);
    clock.advance(Duration::from_secs(61));
    let lookup = cache.names_for(&sb, ip("203.0.113.7"));
    assert!(
        matches!(lookup.names(), Cow::Owned(_)),
        "partly expired: a filtered copy"
    );
    assert_eq!(live(&cache, &sb, "203.0.113.7"), ["b.test"]);
    // A shorter, later answer does not cut an earlier one short.
    cache.record(&sb, &attr(&["b.test"], &["203.0.113.7"], 30));
    clock.advance(Duration::from_secs(200));
    assert_eq!(live(&cache, &sb, "203.0.113.7"), ["b.test"]);
}

#[test]
fn live_lookups_borrow() {
    let (_clock, cache) = setup(CacheConfig::default());
    let sb = SandboxId::new("a");
    cache.record(&sb, &attr(&["a.test", "b.test"], &["203.0.113.7"], 60));
    assert!(matches!(
        cache.names_for(&sb, ip("203.0.113.7")).names(),
        Cow::Borrowed(_)
    ));
}

#[test]
fn sandboxes_are_isolated() {
    let (_clock, cache) = setup(CacheConfig::default());
    let (a, b) = (SandboxId::new("a"), SandboxId::new("b"));
    cache.record(&a, &attr(&["api.test"], &["203.0.113.7"], 60));
    assert_eq!(live(&cache, &a, "203.0.113.7"), ["api.test"]);
    assert_eq!(
        cache.names_for(&b, ip("203.0.113.7")).gap(),
        AttributionGap::NoDnsSeen
    );
    assert!(cache.names_for(&b, ip("203.0.113.7")).names().is_empty());
}

#[test]
fn a_flooding_sandbox_evicts_only_its_own_entries() {
    let config = CacheConfig {
        per_sandbox_ips: 100,
        ..CacheConfig::default()
    };
    let (_clock, cache) = setup(config);
    let (quiet, noisy) = (SandboxId::new("quiet"), SandboxId::new("noisy"));
    cache.record(&quiet, &attr(&["api.test"], &["203.0.113.7"], 60));
    for i in 0..20_000u32 {
        let addr = std::net::Ipv4Addr::from(0xc633_0000 + i).to_string(); // 198.51.x.y
        cache.record(&noisy, &attr(&[&format!("n{i}.flood.test")], &[&addr], 60));
    }
    cache.sync();
    assert!(
        cache.entry_count() <= 101,
        "bounded: {}",
        cache.entry_count()
    );
    assert!(
        cache.evictions() >= 19_000,
        "evictions counted: {}",
        cache.evictions()
    );
    assert_eq!(live(&cache, &quiet, "203.0.113.7"), ["api.test"]);
    let newest = std::net::Ipv4Addr::from(0xc633_0000 + 19_999).to_string();
    assert_eq!(
        live(&cache, &noisy, &newest),
        ["n19999.flood.test"],
        "a fresh answer is always admitted"
    );
    // Recently evicted addresses (not the newest 100, which are cached)
    // read as evicted, not as never seen.
    let gaps: Vec<AttributionGap> = (19_700..19_900u32)
        .map(|i| {
            cache
                .names_for(
                    &noisy,
                    IpAddr::V4(std::net::Ipv4Addr::from(0xc633_0000 + i)),
                )
                .gap()
        })
        .collect();
    let evicted = gaps
        .iter()
        .filter(|g| **g == AttributionGap::Evicted)
        .count();
    assert!(
        evicted > 180,
        "{evicted} of 200 recently evicted read as evicted: {gaps:?}"
    );
}

#[test]
fn names_per_ip_and_sandbox_count_are_bounded() {
    let config = CacheConfig {
        names_per_ip: 4,
        max_sandboxes: 2,
        ..CacheConfig::default()
    };
    let (_clock, cache) = setup(config);
    let sb = SandboxId::new("a");
    for i in 0..10u32 {
        cache.record(
            &sb,
            &attr(&[&format!("n{i}.test")], &["203.0.113.7"], 60 + i),
        );
    }
    assert_eq!(
        live(&cache, &sb, "203.0.113.7"),
        ["n6.test", "n7.test", "n8.test", "n9.test"],
        "latest-expiring kept"
    );
    assert!(cache.record(
        &SandboxId::new("b"),
        &attr(&["x.test"], &["203.0.113.1"], 60)
    ));
    assert!(
        !cache.record(
            &SandboxId::new("c"),
            &attr(&["x.test"], &["203.0.113.1"], 60)
        ),
        "third sandbox refused"
    );
    assert_eq!(cache.refused_sandboxes(), 1);
    cache.remove_sandbox(&SandboxId::new("b"));
    assert!(
        cache.record(
            &SandboxId::new("c"),
            &attr(&["x.test"], &["203.0.113.1"], 60)
        ),
        "room again"
    );
}

/// An address full of names with long TTLs keeps a name just answered
/// for it with a short one: the sandbox connects on it next. The names it
/// makes room by are the old ones soonest to expire.
#[test]
fn a_name_just_answered_is_kept_however_short_its_ttl() {
    let config = CacheConfig {
        names_per_ip: 4,
        ..CacheConfig::default()
    };
    let (_clock, cache) = setup(config);
    let sb = SandboxId::new("a");
    for i in 0..4u32 {
        let name = format!("long{i}.test");
        cache.record(&sb, &attr(&[&name], &["203.0.113.7"], 3_600 + i));
    }
    cache.record(&sb, &attr(&["short.test"], &["203.0.113.7"], 60));
    assert_eq!(
        live(&cache, &sb, "203.0.113.7"),
        ["long1.test", "long2.test", "long3.test", "short.test"]
    );
}

#[test]
fn entries_list_live_names_with_remaining_ttl() {
    let (clock, cache) = setup(CacheConfig::default());
    let sb = SandboxId::new("a");
    cache.record(
        &sb,
        &attr(&["api.test"], &["203.0.113.7", "2001:db8::7"], 120),
    );
    clock.advance(Duration::from_secs(20));
    let e = cache.entries(&sb);
    assert_eq!(e.len(), 2);
    assert_eq!(e[0].0, ip("203.0.113.7"));
    assert_eq!(e[0].1, [(h("api.test"), Duration::from_secs(100))]);
    assert!(cache.entries(&SandboxId::new("nobody")).is_empty());
}

#[test]
fn the_least_recently_used_address_goes_first_and_a_lookup_is_a_use() {
    let config = CacheConfig {
        per_sandbox_ips: 3,
        ..CacheConfig::default()
    };
    let (_clock, cache) = setup(config);
    let sb = SandboxId::new("a");
    for (n, a) in [
        ("one.test", "203.0.113.1"),
        ("two.test", "203.0.113.2"),
        ("three.test", "203.0.113.3"),
    ] {
        cache.record(&sb, &attr(&[n], &[a], 60));
    }
    // .1 is read, so .2 is now the least recently used.
    assert_eq!(live(&cache, &sb, "203.0.113.1"), ["one.test"]);
    cache.record(&sb, &attr(&["four.test"], &["203.0.113.4"], 60));
    assert_eq!(cache.entry_count(), 3);
    assert_eq!(cache.evictions(), 1);
    assert_eq!(
        cache.names_for(&sb, ip("203.0.113.2")).gap(),
        AttributionGap::Evicted
    );
    for (n, a) in [
        ("one.test", "203.0.113.1"),
        ("three.test", "203.0.113.3"),
        ("four.test", "203.0.113.4"),
    ] {
        assert_eq!(live(&cache, &sb, a), [n]);
    }
    // Written again, an address is used again: .1 is now the oldest use.
    cache.record(&sb, &attr(&["three.test"], &["203.0.113.3"], 60));
    cache.record(&sb, &attr(&["two.test"], &["203.0.113.2"], 60));
    assert_eq!(
        cache.names_for(&sb, ip("203.0.113.1")).gap(),
        AttributionGap::Evicted
    );
    assert_eq!(
        live(&cache, &sb, "203.0.113.2"),
        ["two.test"],
        "no longer a ghost"
    );
    assert_eq!(cache.evictions(), 2);
}

#[test]
fn a_lookup_keeps_its_snapshot_while_the_address_is_recorded_again() {
    let (clock, cache) = setup(CacheConfig::default());
    let sb = SandboxId::new("a");
    cache.record(&sb, &attr(&["a.test"], &["203.0.113.7"], 60));
    let held = cache.names_for(&sb, ip("203.0.113.7"));
    // Merged into a copy: the held lookup still reads what it found.
    cache.record(&sb, &attr(&["b.test"], &["203.0.113.7"], 60));
    assert_eq!(held.names().len(), 1);
    assert_eq!(held.names()[0], h("a.test"));
    drop(held);
    // Nobody holds it now: merged in place.
    cache.record(&sb, &attr(&["c.test"], &["203.0.113.7"], 120));
    assert_eq!(
        live(&cache, &sb, "203.0.113.7"),
        ["a.test", "b.test", "c.test"]
    );
    // In place, expired names are dropped as well.
    clock.advance(Duration::from_secs(90));
    cache.record(&sb, &attr(&["d.test"], &["203.0.113.7"], 60));
    assert_eq!(live(&cache, &sb, "203.0.113.7"), ["c.test", "d.test"]);
    assert!(matches!(
        cache.names_for(&sb, ip("203.0.113.7")).names(),
        Cow::Borrowed(_)
    ));
}

#[test]
fn a_restored_attribution_keeps_exactly_what_it_had_left() {
    let (clock, old) = setup(CacheConfig::default());
    let sb = SandboxId::new("a");
    old.record(&sb, &attr(&["api.test", "cdn.test"], &["203.0.113.7"], 300));
    clock.advance(Duration::from_secs(298));
    let entries = old.entries(&sb);
    assert_eq!(entries.len(), 1);
    // A successor (its own clock) restores what is left: two seconds, not
    // the 30 s floor a fresh answer would get.
    let (clock2, new) = setup(CacheConfig::default());
    let (addr, names) = &entries[0];
    assert!(new.restore(&sb, *addr, names));
    assert_eq!(live(&new, &sb, "203.0.113.7"), ["api.test", "cdn.test"]);
    clock2.advance(Duration::from_millis(1_999));
    assert_eq!(live(&new, &sb, "203.0.113.7"), ["api.test", "cdn.test"]);
    clock2.advance(Duration::from_millis(1));
    assert!(matches!(
        new.names_for(&sb, ip("203.0.113.7")),
        Lookup::Missing(AttributionGap::Expired)
    ));
    // Never beyond max_ttl.
    assert!(new.restore(
        &sb,
        ip("203.0.113.9"),
        &[(h("long.test"), Duration::from_secs(10 * 86_400))]
    ));
    clock2.advance(Duration::from_secs(24 * 3600));
    assert!(live(&new, &sb, "203.0.113.9").is_empty());
}

#[test]
fn long_names_are_bounded_by_their_weight_per_sandbox() {
    // 17 names of 200+ bytes an answer, TTL 0 (floored, then expired but
    // held until the address is written again): without a bound by weight,
    // only the 65,536 addresses would bound them.
    let config = CacheConfig {
        name_bytes_per_sandbox: 256 * 1024,
        ..CacheConfig::default()
    };
    let (clock, cache) = setup(config);
    let (quiet, noisy) = (SandboxId::new("quiet"), SandboxId::new("noisy"));
    cache.record(&quiet, &attr(&["api.test"], &["203.0.113.7"], 86_400));
    let label = "x".repeat(60);
    for i in 0..2_000u32 {
        let names: Vec<String> = (0..17)
            .map(|j| format!("{label}.{label}.{label}.n{i}-{j}.test"))
            .collect();
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        let addr = std::net::Ipv4Addr::from(0xc633_6400 + (i % 256)).to_string(); // 198.51.100.x
        let addr6 = format!("2001:db8::{i:x}");
        cache.record(&noisy, &attr(&names, &[&addr, &addr6], 0));
        clock.advance(Duration::from_secs(1));
    }
    let held: usize = cache
        .entries(&noisy)
        .iter()
        .flat_map(|(_, names)| names)
        .map(|(n, _)| n.as_str().len() + super::NAME_OVERHEAD)
        .sum();
    assert!(held <= 256 * 1024, "live names weigh {held} bytes");
    assert!(cache.evictions() > 0, "evicted for weight");
    // Another sandbox's entry is untouched.
    assert_eq!(live(&cache, &quiet, "203.0.113.7"), ["api.test"]);
    // Every address still held is within the bound too, expired names included.
    let all = cache.existing(&noisy).expect("a cache");
    assert!(all.weight.load(Ordering::Relaxed) <= 256 * 1024);
}

#[test]
fn an_ipv4_mapped_address_is_its_ipv4_address() {
    let (_clock, cache) = setup(CacheConfig::default());
    let sb = SandboxId::new("a");
    cache.record(&sb, &attr(&["mapped.test"], &["::ffff:203.0.113.7"], 60));
    assert_eq!(live(&cache, &sb, "203.0.113.7"), ["mapped.test"]);
    cache.record(&sb, &attr(&["plain.test"], &["198.51.100.9"], 60));
    assert_eq!(live(&cache, &sb, "::ffff:198.51.100.9"), ["plain.test"]);
    let listed: Vec<IpAddr> = cache.entries(&sb).into_iter().map(|(ip, _)| ip).collect();
    assert!(
        listed.contains(&ip("203.0.113.7")) && !listed.iter().any(|a| a.is_ipv6()),
        "{listed:?}"
    );
}
