//! The egress gateway: operator CLI today; the dataplane, DNS interception
//! and admin API arrive with their issues and run from here, so that the
//! integration tests drive the very code the binary runs.

pub mod cli;
mod policy_cmd;
