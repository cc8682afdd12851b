//! The interception CA and the leaves minted under it.
//!
//! - [`CertificateAuthority`]: loaded from PEM files (the key file must not be
//!   readable by group or others; the certificate file may hold a worker's
//!   intermediate and the chain above it) or created (ECDSA P-256, long-lived).
//! - [`request`] and [`sign_intermediate`]: a worker's intermediate under a
//!   fleet root, the worker's key never leaving the worker.
//! - [`LeafMinter`]: mints short-lived leaves for a server name, or for the
//!   destination IP when the client sent no usable SNI. One leaf key pair
//!   serves every leaf, so minting costs one signature; a bounded cache with
//!   single-flight means a thousand concurrent handshakes for a new name mint once.
//! - [`LeafResolver`]: the rustls `ResolvesServerCert` that serves them.
//!
//! Only this crate names rcgen. Its cryptography is aws-lc-rs, the workspace's
//! one crypto library (rustls' provider too).

mod ca;
mod chain;
mod mint;
mod request;
mod resolver;

pub use ca::{
    CaPaths, CertificateAuthority, CA_CERT_FILE, CA_KEY_FILE, DEFAULT_COMMON_NAME, ROOT_COMMON_NAME,
};
pub use mint::{LeafMinter, LeafName, MintConfig};
pub use request::{request, sign_intermediate, Signed, CA_CSR_FILE, DEFAULT_INTERMEDIATE_VALIDITY};
pub use resolver::LeafResolver;

use std::path::PathBuf;

/// Why a CA could not be loaded or created, or a leaf minted.
#[derive(Debug, thiserror::Error)]
pub enum CertError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: the CA key is readable or writable by group or others (mode {mode:04o}); run `chmod 600 {path}`")]
    KeyPermissions { path: PathBuf, mode: u32 },
    #[error("{path}: {message}")]
    Invalid { path: PathBuf, message: String },
    #[error("{dir}: holds {present} but not {missing}; supply both or neither")]
    HalfPresent {
        dir: PathBuf,
        present: &'static str,
        missing: &'static str,
    },
    #[error("{path} already exists; refusing to overwrite a CA")]
    Exists { path: PathBuf },
    #[error("minting a certificate for {name}: {message}")]
    Mint { name: String, message: String },
}
