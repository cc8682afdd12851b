//! A leaf-minting flood: 10,000 distinct SNIs. Minting is single-flight
//! (four threads asking for the same names at once mint each one once), the
//! cache stays within its capacity, and the CPU cost per new SNI is printed.

use std::sync::{Arc, Barrier};
use std::time::Instant;

use egress_certs::{CertificateAuthority, LeafMinter, LeafName, MintConfig};
use egress_policy::Hostname;

const NAMES: usize = 10_000;

fn names() -> Vec<LeafName> {
    (0..NAMES)
        .map(|i| LeafName::Dns(Hostname::parse(&format!("n{i}.flood.example.test")).expect("name")))
        .collect()
}

fn minter(capacity: u64) -> (tempfile::TempDir, Arc<LeafMinter>) {
    let dir = tempfile::tempdir().expect("temp dir");
    let ca = Arc::new(CertificateAuthority::create(dir.path()).expect("CA"));
    let config = MintConfig {
        cache_capacity: capacity,
        ..MintConfig::default()
    };
    (dir, Arc::new(LeafMinter::new(ca, config).expect("minter")))
}

#[test]
fn ten_thousand_snis_mint_once_each_and_the_cache_stays_bounded() {
    // Single flight: four threads ask for every name, in the same order, at once.
    let (_dir, m) = minter(100_000);
    let names = Arc::new(names());
    let start = Arc::new(Barrier::new(4));
    std::thread::scope(|s| {
        for _ in 0..4 {
            let (m, names, start) = (m.clone(), names.clone(), start.clone());
            s.spawn(move || {
                start.wait();
                for n in names.iter() {
                    m.leaf(n).expect("minted");
                }
            });
        }
    });
    assert_eq!(m.minted(), NAMES as u64, "each name minted exactly once");

    // Bounded: a small cache under the same flood keeps at most its capacity.
    let (_dir, m) = minter(1_000);
    let started = Instant::now();
    for n in names.iter() {
        m.leaf(n).expect("minted");
    }
    let elapsed = started.elapsed();
    m.sync_cache();
    assert_eq!(m.minted(), NAMES as u64);
    assert!(
        m.cached() <= 1_000,
        "cache {} over its capacity",
        m.cached()
    );
    // One thread did all the work: its wall time is the CPU time.
    let per = elapsed.as_secs_f64() * 1e6 / NAMES as f64;
    println!(
        "leaf-minting flood: {NAMES} distinct SNIs x 4 threads minted {NAMES} leaves (single-flight); \
         a 1,000-leaf cache holds {} after the flood; {per:.0} µs of CPU per new SNI ({} build)",
        m.cached(),
        if cfg!(debug_assertions) { "debug" } else { "release" }
    );
}
