//! Putting a new interception CA in service without a restart.
//!
//! SIGHUP reads `tls.ca_cert` and `tls.ca_key` again (or `state_dir/ca` for
//! a CA the gateway created). Files that changed and load (the chain checked
//! as at start) go into service for the next handshakes, and the leaves
//! cached under the old CA are dropped; connections already established keep
//! the leaf they were handed. Files that do not load leave the CA in service
//! untouched and say why, naming the file: a reload never creates a CA and
//! never stops the gateway serving. Each attempt counts in
//! `egress_tls_ca_reloads_total{result}`.

use std::sync::Arc;

use egress_certs::{CaPaths, CertError, CertificateAuthority, LeafMinter};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

use crate::config::Config;
use crate::metrics::ResultLabels;

/// Reloads the CA files into the minter every handshake reaches.
#[derive(Clone)]
pub struct CaReloader {
    minter: Arc<LeafMinter>,
    paths: CaPaths,
    reloads: Family<ResultLabels, Counter>,
}

/// What a reload did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CaReload {
    /// The files hold the CA in service.
    Unchanged,
    /// A new CA mints the next leaves.
    Replaced {
        subject: String,
        fingerprint: String,
    },
}

// === impl CaReloader ===

impl CaReloader {
    pub(crate) fn new(
        minter: Arc<LeafMinter>,
        config: &Config,
        reloads: Family<ResultLabels, Counter>,
    ) -> Self {
        let paths = config
            .ca_paths()
            .unwrap_or_else(|| CaPaths::in_dir(&config.state_dir.join("ca")));
        Self {
            minter,
            paths,
            reloads,
        }
    }

    /// The files read on each reload.
    pub fn paths(&self) -> &CaPaths {
        &self.paths
    }

    /// Reads the CA files again and puts them in service if they changed;
    /// logs the outcome (an error names the file and the problem).
    pub fn reload(&self) -> Result<CaReload, CertError> {
        let outcome = self.try_reload();
        let result = if outcome.is_ok() { "ok" } else { "error" };
        self.reloads.get_or_create(&ResultLabels { result }).inc();
        match &outcome {
            Ok(CaReload::Unchanged) => {
                tracing::info!(cert = %self.paths.cert.display(), "interception CA unchanged");
            }
            Ok(CaReload::Replaced {
                subject,
                fingerprint,
            }) => {
                tracing::info!(%subject, sha256 = %fingerprint, cert = %self.paths.cert.display(), "interception CA replaced: new handshakes mint under it; open connections keep theirs");
            }
            Err(e) => {
                tracing::error!(error = %e, "interception CA reload failed; the CA in service is kept");
            }
        }
        outcome
    }

    fn try_reload(&self) -> Result<CaReload, CertError> {
        let next = CertificateAuthority::load(&self.paths)?;
        let current = self.minter.ca();
        if next.cert_pem() == current.cert_pem() {
            return Ok(CaReload::Unchanged);
        }
        let replaced = CaReload::Replaced {
            subject: next.subject().to_owned(),
            fingerprint: next.fingerprint().to_owned(),
        };
        self.minter.replace_ca(Arc::new(next))?;
        Ok(replaced)
    }
}

impl std::fmt::Debug for CaReloader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CaReloader")
            .field("paths", &self.paths)
            .finish_non_exhaustive()
    }
}
