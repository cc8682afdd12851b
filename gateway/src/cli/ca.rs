//! `egress-gateway ca …`: the interception CA, from the shell.
//!
//! `init` makes a worker's own CA (or, with `--root`, a fleet root);
//! `request` (on the worker) and `sign` (where the fleet root lives) make a
//! worker's intermediate under the fleet root without its key leaving the
//! worker (`docs/operations.md`, "Fleet: one trust root").

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::Subcommand;
use egress_certs::{CaPaths, CertificateAuthority};

use super::output::fail;

#[derive(Debug, Subcommand)]
pub(super) enum CaCommand {
    /// Create a CA (ECDSA P-256, ten years) in DIR and print the path of the
    /// certificate sandboxes must trust. Never overwrites an existing CA.
    Init {
        #[arg(long, value_name = "DIR")]
        dir: PathBuf,
        /// A fleet root: it signs workers' intermediates (`ca sign`), not leaves.
        #[arg(long)]
        root: bool,
    },
    /// On a worker: make its CA key (DIR/ca.key, mode 0600; an existing key
    /// is kept) and a signing request for it (DIR/ca.csr); print the request's path.
    Request {
        #[arg(long, value_name = "DIR")]
        dir: PathBuf,
        /// The intermediate's common name (default: "egress-gateway worker HOSTNAME").
        #[arg(long)]
        name: Option<String>,
    },
    /// Where the fleet root lives: issue a worker's intermediate CA for its
    /// request and write it, followed by the root, to OUT (never overwritten).
    Sign {
        #[arg(long, value_name = "FILE")]
        root_cert: PathBuf,
        #[arg(long, value_name = "FILE")]
        root_key: PathBuf,
        #[arg(long, value_name = "FILE")]
        csr: PathBuf,
        #[arg(long, value_name = "FILE")]
        out: PathBuf,
        /// Validity in days (cut at the root's notAfter).
        #[arg(long, default_value_t = 365)]
        days: u32,
    },
}

pub(super) fn run(cmd: CaCommand) -> ExitCode {
    match cmd {
        CaCommand::Init { dir, root } => {
            let made = if root {
                CertificateAuthority::create_root(&dir)
            } else {
                CertificateAuthority::create(&dir)
            };
            match made {
                Ok(ca) => {
                    println!("{}", ca.paths().cert.display());
                    ExitCode::SUCCESS
                }
                Err(e) => fail(e),
            }
        }
        CaCommand::Request { dir, name } => {
            let name = name.unwrap_or_else(default_name);
            match egress_certs::request(&dir, &name) {
                Ok(csr) => {
                    println!("{}", csr.display());
                    ExitCode::SUCCESS
                }
                Err(e) => fail(e),
            }
        }
        CaCommand::Sign {
            root_cert,
            root_key,
            csr,
            out,
            days,
        } => sign(
            &CaPaths {
                cert: root_cert,
                key: root_key,
            },
            &csr,
            &out,
            days,
        ),
    }
}

/// `ca sign`: prints the written file's path; says on stderr when the
/// validity was cut at the root's.
fn sign(root: &CaPaths, csr: &Path, out: &Path, days: u32) -> ExitCode {
    if days == 0 {
        return fail(format_args!("--days: must be at least 1"));
    }
    if out.exists() {
        return fail(format_args!(
            "{} already exists; refusing to overwrite a certificate",
            out.display()
        ));
    }
    let root = match CertificateAuthority::load(root) {
        Ok(r) => r,
        Err(e) => return fail(format_args!("--root-cert/--root-key: {e}")),
    };
    let pem = match std::fs::read_to_string(csr) {
        Ok(p) => p,
        Err(e) => return fail(format_args!("{}: {e}", csr.display())),
    };
    let validity = time::Duration::days(i64::from(days));
    let now = time::OffsetDateTime::now_utc();
    let signed = match egress_certs::sign_intermediate(&root, csr, &pem, validity, now) {
        Ok(s) => s,
        Err(e) => return fail(e),
    };
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(out)
        .and_then(|mut f| std::io::Write::write_all(&mut f, signed.chain_pem.as_bytes()));
    if let Err(e) = written {
        return fail(format_args!("{}: {e}", out.display()));
    }
    if signed.clamped {
        eprintln!(
            "note: valid until {}, the root's notAfter, not {days} days",
            signed.not_after
        );
    }
    println!("{}", out.display());
    ExitCode::SUCCESS
}

/// "egress-gateway worker HOSTNAME", or without a readable hostname
/// "egress-gateway worker CA".
fn default_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .map_or_else(
            || "egress-gateway worker CA".to_owned(),
            |h| format!("egress-gateway worker {h}"),
        )
}
