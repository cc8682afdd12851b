//! Criterion benchmarks live in `benches/`; the traffic-replay tool will live here.
