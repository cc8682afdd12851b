//! Criterion benchmarks live in `benches/`, the replay tool in `src/bin/replay.rs`.
