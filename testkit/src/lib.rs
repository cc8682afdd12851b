//! What every crate's tests share about prerequisites they may not find
//! (root, nft, a PostgreSQL cluster, CAP_BPF, promtool).
//!
//! A test that cannot run here says so and passes — unless CI asked for the
//! whole suite with `EGRESS_E2E_REQUIRED=1`, where a skip would hide a test
//! that never ran, so it fails instead. Every crate reads the variable through
//! [`required`] and skips through [`skip`], so there is one reading (exactly
//! `"1"`) and one spelling of the line a skip prints:
//!
//! ```text
//! SKIPPED: <what>: <why>
//! ```
//!
//! `grep -r '^SKIPPED: '` over a test log finds every skip.
//!
//! ```
//! fn nft_present() -> bool {
//!     let ok = std::process::Command::new("nft").arg("--version").output().is_ok();
//!     if !ok {
//!         egress_testkit::skip("nft_accepts_every_mode", "no nft here");
//!     }
//!     ok
//! }
//! # let _ = nft_present;
//! ```
//!
//! The API is stable: [`REQUIRED_VAR`], [`required`], [`skip`].

use std::fmt::Display;

/// The environment variable CI sets to `1` to make every skip a failure.
pub const REQUIRED_VAR: &str = "EGRESS_E2E_REQUIRED";

/// Whether missing prerequisites are failures: true iff
/// `EGRESS_E2E_REQUIRED` is exactly `"1"` (unset, empty, `0` or anything
/// else: skips are allowed).
#[must_use]
pub fn required() -> bool {
    std::env::var_os(REQUIRED_VAR).is_some_and(|v| v == "1")
}

/// Reports that `what` (a test or a group of tests) cannot run here because
/// of `why`: prints `SKIPPED: <what>: <why>` to stderr and returns, so the
/// caller returns early and the test passes.
///
/// # Panics
///
/// At the caller's line, when [`required`] — CI wants every test to run — with
/// `<what> is required (EGRESS_E2E_REQUIRED=1): <why>`.
#[track_caller]
pub fn skip(what: &str, why: impl Display) {
    assert!(!required(), "{what} is required ({REQUIRED_VAR}=1): {why}");
    eprintln!("SKIPPED: {what}: {why}");
}

/// A TCP port on 127.0.0.1 that refuses connections, held (bound, never
/// listening) for as long as the returned socket lives. A port merely freed
/// (a listener bound and dropped) can be handed to the next bind in between,
/// another test's listener or the code under test's own, and the
/// "unreachable" address answers (it did once in CI).
///
/// # Panics
///
/// If the socket cannot be made or bound.
#[must_use]
pub fn closed_port() -> (std::net::SocketAddr, socket2::Socket) {
    let s =
        socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).expect("socket");
    s.bind(&std::net::SocketAddr::from(([127, 0, 0, 1], 0)).into())
        .expect("bind");
    let addr = s
        .local_addr()
        .expect("address")
        .as_socket()
        .expect("an IP address");
    (addr, s)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tests of this crate run in one process and share its
    /// environment: one test covers every value so none race another.
    #[test]
    fn only_exactly_one_is_required_and_a_required_skip_panics() {
        let before = std::env::var_os(REQUIRED_VAR);
        for (value, want) in [
            (None, false),
            (Some(""), false),
            (Some("0"), false),
            (Some("true"), false),
            (Some("1 "), false),
            (Some("1"), true),
        ] {
            match value {
                Some(v) => std::env::set_var(REQUIRED_VAR, v),
                None => std::env::remove_var(REQUIRED_VAR),
            }
            assert_eq!(required(), want, "{REQUIRED_VAR}={value:?}");
            let skipped = std::panic::catch_unwind(|| skip("this test", "a reason"));
            assert_eq!(skipped.is_err(), want, "{REQUIRED_VAR}={value:?}");
        }
        match before {
            Some(v) => std::env::set_var(REQUIRED_VAR, v),
            None => std::env::remove_var(REQUIRED_VAR),
        }
    }
}
