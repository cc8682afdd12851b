//! Leaf minting and the leaf cache.

use std::fmt;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use egress_policy::Hostname;
use rcgen::{
    CertificateParams, DnType, ExtendedKeyUsagePurpose, KeyPair, KeyUsagePurpose, SanType,
    SerialNumber, PKCS_ECDSA_P256_SHA256,
};
use ring::rand::{SecureRandom, SystemRandom};
use rustls::crypto::ring::sign::any_ecdsa_type;
use rustls::sign::{CertifiedKey, SigningKey};
use rustls_pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer};
use time::{Duration, OffsetDateTime};

use crate::{CertError, CertificateAuthority};

/// What a leaf is minted for.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum LeafName {
    /// The client's SNI, validated and normalised.
    Dns(Hostname),
    /// The original destination, for a handshake without a usable SNI.
    Ip(IpAddr),
}

/// Leaf minting settings.
#[derive(Clone, Debug)]
pub struct MintConfig {
    /// How long a leaf is valid from now (default 7 days).
    pub validity: Duration,
    /// How far `notBefore` lies in the past, for clients with slow clocks (default 1 hour).
    pub backdate: Duration,
    /// Most leaves kept (default 10,000). Each costs about 1 KiB.
    pub cache_capacity: u64,
}

/// Mints leaves under a CA and keeps the recent ones.
pub struct LeafMinter {
    ca: Arc<CertificateAuthority>,
    /// One key pair for every leaf: minting then costs one signature.
    leaf_key: KeyPair,
    leaf_signer: Arc<dyn SigningKey>,
    config: MintConfig,
    cache: moka::sync::Cache<LeafName, Arc<CertifiedKey>>,
    rng: SystemRandom,
    minted: AtomicU64,
}

// === impl LeafName ===

impl fmt::Display for LeafName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Dns(h) => h.fmt(f),
            Self::Ip(ip) => ip.fmt(f),
        }
    }
}

// === impl MintConfig ===

impl Default for MintConfig {
    fn default() -> Self {
        Self {
            validity: Duration::days(7),
            backdate: Duration::hours(1),
            cache_capacity: 10_000,
        }
    }
}

// === impl LeafMinter ===

impl LeafMinter {
    pub fn new(ca: Arc<CertificateAuthority>, config: MintConfig) -> Result<Self, CertError> {
        let err = |message: String| CertError::Mint {
            name: "the leaf key".into(),
            message,
        };
        let leaf_key =
            KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).map_err(|e| err(e.to_string()))?;
        let der = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(leaf_key.serialize_der()));
        let leaf_signer = any_ecdsa_type(&der).map_err(|e| err(e.to_string()))?;
        // A cached leaf is replaced well before it expires: at half its validity.
        let ttl = std::time::Duration::try_from(config.validity / 2).unwrap_or_default();
        let cache = moka::sync::Cache::builder()
            .max_capacity(config.cache_capacity)
            .time_to_live(ttl)
            .build();
        Ok(Self {
            ca,
            leaf_key,
            leaf_signer,
            config,
            cache,
            rng: SystemRandom::new(),
            minted: AtomicU64::new(0),
        })
    }

    /// The leaf for `name`, from the cache or freshly minted. Concurrent
    /// callers for one uncached name wait for a single mint.
    pub fn leaf(&self, name: &LeafName) -> Result<Arc<CertifiedKey>, Arc<CertError>> {
        self.cache.try_get_with_by_ref(name, || self.mint(name))
    }

    /// Leaves minted since start (a metric).
    pub fn minted(&self) -> u64 {
        self.minted.load(Ordering::Relaxed)
    }

    /// Leaves in the cache now (a metric; approximate until pending work runs).
    pub fn cached(&self) -> u64 {
        self.cache.entry_count()
    }

    /// Applies pending cache maintenance (evictions), so `cached` is exact.
    pub fn sync_cache(&self) {
        self.cache.run_pending_tasks();
    }

    pub fn ca(&self) -> &CertificateAuthority {
        &self.ca
    }

    fn mint(&self, name: &LeafName) -> Result<Arc<CertifiedKey>, CertError> {
        let err = |message: String| CertError::Mint {
            name: name.to_string(),
            message,
        };
        let mut params = CertificateParams::default();
        match name {
            LeafName::Dns(h) => {
                let ia5 = h
                    .as_str()
                    .try_into()
                    .map_err(|e: rcgen::Error| err(e.to_string()))?;
                params.subject_alt_names = vec![SanType::DnsName(ia5)];
                // commonName is at most 64 characters (RFC 5280 ub-common-name);
                // clients match on the SAN anyway.
                if h.as_str().len() <= 64 {
                    params
                        .distinguished_name
                        .push(DnType::CommonName, h.as_str());
                }
            }
            LeafName::Ip(ip) => {
                params.subject_alt_names = vec![SanType::IpAddress(*ip)];
                params
                    .distinguished_name
                    .push(DnType::CommonName, ip.to_string());
            }
        }
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.use_authority_key_identifier_extension = true;
        let now = OffsetDateTime::now_utc();
        params.not_before = now - self.config.backdate;
        params.not_after = now + self.config.validity;
        let mut serial = [0u8; 16];
        self.rng
            .fill(&mut serial)
            .map_err(|_| err("no randomness for the serial number".into()))?;
        serial[0] &= 0x7f; // positive, as RFC 5280 requires
        serial[0] |= 0x01; // and sixteen bytes long
        params.serial_number = Some(SerialNumber::from_slice(&serial));
        let cert = params
            .signed_by(&self.leaf_key, self.ca.issuer())
            .map_err(|e| err(e.to_string()))?;
        self.minted.fetch_add(1, Ordering::Relaxed);
        let chain = vec![cert.der().clone(), self.ca.cert_der().clone()];
        Ok(Arc::new(CertifiedKey::new(chain, self.leaf_signer.clone())))
    }
}

impl fmt::Debug for LeafMinter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeafMinter")
            .field("ca", &self.ca)
            .field("config", &self.config)
            .field("minted", &self.minted())
            .finish_non_exhaustive()
    }
}
