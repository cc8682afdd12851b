#![allow(unreachable_pub)] // a test binary: `pub` only shares the harness between its modules
//! The dataplane in-process on loopback: real sockets, real TLS handshakes,
//! a hickory-server upstream, origins with certificates from a test CA.

mod budgets;
mod ca_rotation;
mod cut_origin;
mod doh;
mod drain;
mod ech;
mod explain;
mod faults;
mod harness;
mod hello_retry;
mod http2;
mod live_policy;
mod parking;
mod per_core;
mod pooling;
mod proposals;
mod shadow;
mod stalled_origin;
mod streams;
mod two_readings;
mod upstream_proxy;
mod verdicts;
