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
//! The API is stable: [`REQUIRED_VAR`], [`required`], [`skip`]; beside it
//! [`closed_port`] and [`spare_port`] hand out loopback ports that do not race.

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

/// A TCP port free right now on 127.0.0.1 and `[::]`, for a process (or a
/// listener) the test starts later on it, chosen below the kernel's
/// ephemeral range (`net.ipv4.ip_local_port_range`).
///
/// A port from a bind to port 0, dropped, lies in the ephemeral range, which
/// every outgoing connection and every other bind to port 0 draws from; one
/// of them took such a port between the drop and the gateway's bind (it did
/// once in CI: `cannot listen on listen.admin … Address already in use`).
/// Below that range only another test's pick can collide, one chance in
/// some twenty thousand, and each pick starts at a random place.
///
/// # Panics
///
/// If no port in the range can be bound.
#[must_use]
pub fn spare_port() -> u16 {
    use std::hash::BuildHasher;
    use std::sync::atomic::{AtomicU64, Ordering};
    static PICKS: AtomicU64 = AtomicU64::new(0);
    let (low, high) = spare_range();
    let span = u64::from(high - low);
    let start = std::hash::RandomState::new().hash_one(PICKS.fetch_add(1, Ordering::Relaxed));
    (0..span)
        .map(|i| low + u16::try_from((start + i) % span).expect("within the span"))
        .find(|&port| free(port))
        .expect("a free port below the ephemeral range")
}

/// The ports [`spare_port`] draws from: 10,000 up to where the ephemeral
/// range starts (32,768 where it cannot be read).
fn spare_range() -> (u16, u16) {
    let first_ephemeral = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32_768);
    if first_ephemeral > 11_000 {
        (10_000, first_ephemeral)
    } else {
        (1_024, first_ephemeral.max(1_025))
    }
}

/// Whether `port` can be bound for TCP on 127.0.0.1 and on `[::]` (where
/// this machine has IPv6).
fn free(port: u16) -> bool {
    let v4 = std::net::TcpListener::bind(("127.0.0.1", port)).is_ok();
    v4 && std::net::TcpListener::bind(("::", port))
        .map_or_else(|e| e.kind() != std::io::ErrorKind::AddrInUse, |_| true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spare_port_is_free_and_below_the_ephemeral_range() {
        let (low, high) = spare_range();
        let picks: Vec<u16> = (0..8).map(|_| spare_port()).collect();
        for &port in &picks {
            assert!((low..high).contains(&port), "{port} not in {low}..{high}");
            let held = std::net::TcpListener::bind(("127.0.0.1", port));
            assert!(held.is_ok(), "{port} was handed out but cannot be bound");
            assert!(!free(port), "{port} reads as free while it is bound");
        }
        let distinct: std::collections::HashSet<_> = picks.iter().collect();
        assert!(distinct.len() > 1, "eight picks all gave {}", picks[0]);
    }

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
