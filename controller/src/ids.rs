//! Identifiers the controller makes: random, URL-safe, and valid sandbox ids.

use aws_lc_rs::rand::{SecureRandom, SystemRandom};

/// `prefix` and 16 random bytes in hex (`sb-3f…`).
pub fn new(prefix: &str) -> String {
    let mut bytes = [0u8; 16];
    // The system RNG does not fail on Linux; zeros would still be a valid
    // id (a repeat is refused by the store's unique keys), but say so.
    if let Err(error) = SystemRandom::new().fill(&mut bytes) {
        tracing::error!(%error, "the system random number generator failed");
    }
    let mut out = String::with_capacity(prefix.len() + 33);
    out.push_str(prefix);
    out.push('-');
    for b in bytes {
        out.push_str(&format!("{b:02x}"));
    }
    out
}

/// The SHA-256 of `bytes`, in hex: an idempotency fingerprint.
pub fn fingerprint(bytes: &[u8]) -> String {
    aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, bytes)
        .as_ref()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}
