//! The egress gateway: the dataplane (transparent capture, peek, decide,
//! splice, intercept), DNS interception, and the operator CLI. The binary is
//! a thin shell over [`Gateway`], so integration tests drive the very code it runs.

mod admin;
pub mod aes_gcm;
pub mod authority;
mod budget;
mod ca_reload;
pub mod cli;
mod commit;
pub mod config;
mod control_http;
pub mod credentials;
pub mod decide;
pub mod doh;
mod fault;
mod flow;
pub mod flowlog;
mod gateway;
mod h2client;
pub mod handover;
mod hello_retry;
mod intercept;
mod io;
pub mod journal;
mod ksplice;
mod metrics;
mod neighbours;
pub mod peek;
pub mod persist;
mod pool;
mod proposed;
pub mod redirect;
pub mod registry;
mod reply;
pub mod shadow;
mod slots;
mod splice;
mod spliced;
mod state;
mod systemd;
#[cfg(test)]
mod test_util;
mod upstream;
pub mod upstream_proxy;

pub use ca_reload::{CaReload, CaReloader};
pub use flow::not_judged_by_policy;
pub use gateway::{preflight, Bound, Gateway, SoOriginalDst, StartError};
pub use state::{Dataplane, OriginalDst};
pub use upstream::RootsError;
