//! `egress-gateway-sysalloc`: the gateway binary on the system allocator
//! instead of mimalloc, and otherwise the same code (`cli::main`), so that
//! heap profilers that interpose `malloc` (heaptrack, valgrind's massif or
//! dhat) see every allocation. For memory breakdowns only; its RSS is glibc
//! malloc's, not the gateway's.
//!
//! `heaptrack target/release/egress-gateway-sysalloc run --config …`

use std::process::ExitCode;

#[global_allocator]
static ALLOCATOR: std::alloc::System = std::alloc::System;

fn main() -> ExitCode {
    egress_gateway::cli::main()
}
