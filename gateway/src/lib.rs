//! The egress gateway: the dataplane (transparent capture, peek, decide,
//! splice, intercept), DNS interception, and the operator CLI. The binary is
//! a thin shell over [`run`], so integration tests drive the very code it runs.

pub mod cli;
pub mod config;
pub mod peek;
mod policy_cmd;
