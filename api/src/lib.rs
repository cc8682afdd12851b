//! The HTTP contract the project's binaries share, so it is written once:
//!
//! - [`reply`]: the reply type, JSON replies, errors that name the field;
//! - [`body`]: the bounded body reader (`413` past the cap, `400` for bytes
//!   that are not UTF-8 or not the document) and the NDJSON line reader;
//! - [`serve`]: the accept loop every listener runs (backoff when accepting
//!   fails, a deadline on request heads);
//! - [`file`]: the atomic write of the state files the gateway keeps;
//! - [`explain`]: the gateway admin API's explain question, read once for
//!   the admin route, the `policy explain` command and the fuzz targets;
//! - [`text`]: text from elsewhere cut to a bound for a message.
//!
//! It depends on the pure policy crate only; the gateway, the controller
//! and the cluster components depend on it, never the other way round.

// Readers return `Result<_, Reply>`: the error is the finished answer (a
// 4xx), built once per request, so it is not boxed.
#![allow(clippy::result_large_err)]

pub mod body;
pub mod client;
pub mod explain;
pub mod file;
pub mod gateway;
pub mod reply;
pub mod serve;
pub mod text;

pub use reply::Reply;
