//! `egress-gateway`: parses arguments and hands over to the library.

use std::process::ExitCode;

/// mimalloc: the proxy paths allocate and free small buffers per request on
/// every worker thread, where it costs less CPU than the system allocator.
/// It reads its options from the environment; the packaged units set
/// `MIMALLOC_ALLOW_THP=0` (capacity a connection never touches stays
/// unresident) and `MIMALLOC_PURGE_DELAY=0` (a free page goes back to the
/// system at once, so a burst's memory returns when its connections close).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    egress_gateway::cli::main()
}
