//! The rustls server-certificate resolver for terminated flows.

use std::net::IpAddr;
use std::sync::Arc;

use egress_policy::Hostname;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;

use crate::{LeafMinter, LeafName};

/// Serves minted leaves: for the SNI when it is a valid hostname, else for
/// the flow's original destination IP.
#[derive(Debug, Clone)]
pub struct LeafResolver {
    minter: Arc<LeafMinter>,
    fallback_ip: Option<IpAddr>,
}

impl LeafResolver {
    /// `fallback_ip` (the original destination) is used when the client
    /// sends no SNI, or one that is not a hostname (an IP literal, say).
    pub fn new(minter: Arc<LeafMinter>, fallback_ip: Option<IpAddr>) -> Self {
        Self {
            minter,
            fallback_ip,
        }
    }

    /// What to mint for a ClientHello's server name.
    pub fn leaf_name(&self, sni: Option<&str>) -> Option<LeafName> {
        sni.and_then(|s| Hostname::parse(s).ok())
            .map(LeafName::Dns)
            .or(self.fallback_ip.map(LeafName::Ip))
    }
}

impl ResolvesServerCert for LeafResolver {
    fn resolve(&self, hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        let name = self.leaf_name(hello.server_name())?;
        match self.minter.leaf(&name) {
            Ok(leaf) => Some(leaf),
            Err(e) => {
                // No certificate aborts the handshake: the flow fails closed.
                tracing::warn!(%name, error = %e, "no leaf certificate");
                None
            }
        }
    }
}
