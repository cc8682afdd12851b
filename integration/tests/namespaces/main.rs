//! End to end in network namespaces: real sandboxes behind real nftables
//! redirect rules, ordinary clients (curl, dig, a Rust probe), the gateway
//! binary, and a fake internet. Needs root, nft, ip, curl and dig.

#![allow(unreachable_pub)] // a test binary: `pub` only shares helpers between its modules

mod budgets;
mod chromium;
mod console;
mod controller;
mod demo;
mod dns_policy;
mod dual_stack;
mod fleet;
mod load;
mod machine;
mod requests;
mod scenarios;
mod topology;
mod tuning;
mod unreadable;
mod upstream_proxy;
