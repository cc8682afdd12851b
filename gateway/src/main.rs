//! `egress-gateway`: parses arguments and hands over to the library.

use std::process::ExitCode;

/// mimalloc: the proxy paths allocate and free small buffers per request on
/// every worker thread, where it costs less CPU than the system allocator.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    egress_gateway::cli::main()
}
