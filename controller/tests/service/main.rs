#![allow(unreachable_pub)] // a test binary: `pub` only shares the support module
//! The API service and the dispatcher against a real PostgreSQL (a fresh
//! database per test, on the cluster `DATABASE_URL` names) and real gateways.
//! One test per rule of the specs where it fits; names say the rule.

mod support;

mod approvals;
mod browser;
mod console;
mod creates;
mod fake_gateway;
mod faults;
mod gateways;
mod listing;
mod network;
mod pools;
mod shadow;
mod shards;
