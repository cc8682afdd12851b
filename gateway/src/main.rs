//! `egress-gateway`: parses arguments and hands over to the library.

use std::process::ExitCode;

fn main() -> ExitCode {
    egress_gateway::cli::main()
}
