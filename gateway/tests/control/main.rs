//! The control API over real HTTP, persistence, draining and redirect rules.

#![allow(unreachable_pub)] // a test binary: `pub` only shares helpers between its modules

mod admin;
mod durability;
mod lifecycle;
mod promtool;
mod redirect;
mod shadow;
mod support;
