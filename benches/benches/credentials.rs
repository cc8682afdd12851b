//! The cost of reading a resync's credential values: N sandboxes, each
//! with a source of its own, kept list by list (as a push keeps its own:
//! the table copied once per list) and in one step (as a resync keeps them
//! now), side by side in one run.
//!
//! `cargo bench -p egress-benches --bench credentials`

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use egress_gateway::credentials::{Credential, CredentialSources, Secrets};

/// `n` credentials, each on a file of its own under `dir`.
fn lists(dir: &std::path::Path, n: usize) -> Vec<Vec<Credential>> {
    (0..n)
        .map(|i| {
            let p = dir.join(format!("v{i}"));
            std::fs::write(&p, format!("value-{i}")).expect("write");
            let json = format!(
                r#"[{{"name": "api", "placeholder": "EGRESS_PH_API_0001", "hosts": ["api.example.test"],
                     "inject": {{"replace": "headers"}}, "source": {{"file": "{}"}}}}]"#,
                p.display()
            );
            serde_json::from_str(&json).expect("a credential")
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("dir");
    let sources = || CredentialSources {
        files_under: vec![dir.path().to_owned()],
        env_prefix: String::new(),
    };
    let mut g = c.benchmark_group("resync_credentials");
    g.sample_size(10);
    for n in [500, 2_000] {
        let lists = lists(dir.path(), n);
        g.bench_function(format!("list_by_list/{n}"), |b| {
            b.iter(|| {
                let s = Secrets::new(sources());
                for l in &lists {
                    s.load(l).expect("read");
                }
                black_box(s)
            });
        });
        g.bench_function(format!("one_step/{n}"), |b| {
            b.iter(|| {
                let s = Secrets::new(sources());
                s.load_all(lists.iter().map(|l| &l[..])).expect("read");
                black_box(s)
            });
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
