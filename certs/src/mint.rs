//! Leaf minting and the leaf cache.
//!
//! A minter signs under one *generation* at a time: a CA and a leaf key
//! pair. One key pair serves every leaf of a generation, so minting costs
//! one signature. A new generation begins when the key is older than
//! [`MintConfig::key_lifetime`] (at the next mint; the clock is passed in) or
//! when the CA is replaced ([`LeafMinter::replace_ca`]). Each cached leaf
//! remembers its generation and is never served under a later one, so no
//! leaf outlives its key's lifetime or its CA's replacement in the cache;
//! handshakes already done hold their own `Arc<CertifiedKey>` and go on.

use std::fmt;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock};

use aws_lc_rs::rand::{SecureRandom, SystemRandom};
use egress_policy::Hostname;
use rcgen::{
    CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, KeyPair,
    KeyUsagePurpose, SanType, SerialNumber, PKCS_ECDSA_P256_SHA256,
};
use rustls::crypto::aws_lc_rs::sign::any_ecdsa_type;
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
    /// How long one leaf key pair signs for (default 24 hours): the first
    /// mint after that makes a new one, and leaves under the old key are
    /// no longer served from the cache.
    pub key_lifetime: Duration,
}

/// Mints leaves under a CA and keeps the recent ones.
pub struct LeafMinter {
    /// The CA and key leaves are minted under now.
    current: RwLock<Arc<Generation>>,
    config: MintConfig,
    cache: moka::sync::Cache<LeafName, Cached>,
    rng: SystemRandom,
    minted: AtomicU64,
    /// Generations begun since start (the first is 1).
    generations: AtomicU64,
}

/// A CA and the leaf key pair signing under it.
struct Generation {
    id: u64,
    ca: Arc<CertificateAuthority>,
    /// One key pair for every leaf: minting then costs one signature.
    key: KeyPair,
    signer: Arc<dyn SigningKey>,
    /// When the key stops signing: the first mint at or after this makes a new one.
    retires: OffsetDateTime,
    /// The same, on the monotonic clock: a wall clock stepped back does
    /// not keep a key signing past its lifetime.
    retires_mono: std::time::Instant,
}

/// A cached leaf, the generation it was minted under, and its validity.
#[derive(Clone)]
struct Cached {
    generation: u64,
    leaf: Arc<CertifiedKey>,
    not_before: OffsetDateTime,
    not_after: OffsetDateTime,
}

impl Cached {
    /// Whether it may be served at `now` under `generation`: minted under
    /// it, and valid at `now` (a wall clock stepped back past its start, or
    /// on past its end, mints it again) — or ending with its CA, past which
    /// no leaf minted now would be valid either (a CA that expired while in
    /// service would otherwise cost a mint per handshake).
    fn serves(&self, generation: &Generation, now: OffsetDateTime) -> bool {
        let ends_with_ca = self.not_after >= generation.ca.not_after();
        self.generation == generation.id
            && self.not_before <= now
            && (now < self.not_after || ends_with_ca)
    }
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
            key_lifetime: Duration::hours(24),
        }
    }
}

// === impl LeafMinter ===

impl LeafMinter {
    pub fn new(ca: Arc<CertificateAuthority>, config: MintConfig) -> Result<Self, CertError> {
        Self::new_at(ca, config, OffsetDateTime::now_utc())
    }

    /// [`LeafMinter::new`] with the first key made at `now`.
    pub fn new_at(
        ca: Arc<CertificateAuthority>,
        config: MintConfig,
        now: OffsetDateTime,
    ) -> Result<Self, CertError> {
        let first = Generation::new(1, ca, (now, config.key_lifetime))?;
        // A cached leaf is replaced well before it expires: at half its
        // validity, and never kept past its key's lifetime.
        let half: Duration = config.validity / 2_i32;
        let ttl = half.min(config.key_lifetime);
        let cache = moka::sync::Cache::builder()
            .max_capacity(config.cache_capacity)
            .time_to_live(std::time::Duration::try_from(ttl).unwrap_or_default())
            .build();
        Ok(Self {
            current: RwLock::new(Arc::new(first)),
            config,
            cache,
            rng: SystemRandom::new(),
            minted: AtomicU64::new(0),
            generations: AtomicU64::new(1),
        })
    }

    /// The leaf for `name`, from the cache or freshly minted. Concurrent
    /// callers for one uncached name wait for a single mint.
    pub fn leaf(&self, name: &LeafName) -> Result<Arc<CertifiedKey>, Arc<CertError>> {
        self.leaf_at(name, OffsetDateTime::now_utc())
    }

    /// [`LeafMinter::leaf`] at `now`: the key is renewed first if its
    /// lifetime is over, and a cached leaf of an earlier generation is
    /// minted again.
    pub fn leaf_at(
        &self,
        name: &LeafName,
        now: OffsetDateTime,
    ) -> Result<Arc<CertifiedKey>, Arc<CertError>> {
        let generation = self.generation_at(now).map_err(Arc::new)?;
        let mint = || self.mint(name, &generation, now);
        let cached = self.cache.try_get_with_by_ref(name, mint)?;
        if cached.serves(&generation, now) {
            return Ok(cached.leaf);
        }
        // Minted under an earlier CA or key, or not valid now: replace it
        // (single-flight again).
        self.cache.invalidate(name);
        let cached = self.cache.try_get_with_by_ref(name, mint)?;
        if cached.serves(&generation, now) {
            return Ok(cached.leaf);
        }
        // Another stale entry raced in (a mint begun before the switch): serve
        // a fresh leaf without caching it; the next lookup replaces the entry.
        Ok(mint()?.leaf)
    }

    /// Puts `ca` in service: the next handshakes mint under it with a new
    /// leaf key, and every cached leaf of the old CA is dropped. Leaves
    /// already handed out (open connections) are untouched.
    pub fn replace_ca(&self, ca: Arc<CertificateAuthority>) -> Result<(), CertError> {
        self.replace_ca_at(ca, OffsetDateTime::now_utc())
    }

    /// [`LeafMinter::replace_ca`] with the new key made at `now`.
    pub fn replace_ca_at(
        &self,
        ca: Arc<CertificateAuthority>,
        now: OffsetDateTime,
    ) -> Result<(), CertError> {
        let mut current = self.current.write().unwrap_or_else(PoisonError::into_inner);
        let id = self.generations.fetch_add(1, Ordering::Relaxed) + 1;
        *current = Arc::new(Generation::new(id, ca, (now, self.config.key_lifetime))?);
        drop(current);
        self.cache.invalidate_all();
        Ok(())
    }

    /// Leaves minted since start (a metric).
    pub fn minted(&self) -> u64 {
        self.minted.load(Ordering::Relaxed)
    }

    /// Leaves in the cache now (a metric; approximate until pending work runs).
    pub fn cached(&self) -> u64 {
        self.cache.entry_count()
    }

    /// Leaf keys made since start, the first included (a metric): key
    /// lifetimes that ran out plus CA replacements, plus one.
    pub fn generations(&self) -> u64 {
        self.generations.load(Ordering::Relaxed)
    }

    /// Applies pending cache maintenance (evictions), so `cached` is exact.
    pub fn sync_cache(&self) {
        self.cache.run_pending_tasks();
    }

    /// The CA leaves are minted under now.
    pub fn ca(&self) -> Arc<CertificateAuthority> {
        self.current().ca.clone()
    }

    fn current(&self) -> Arc<Generation> {
        self.current
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The generation in force at `now`, beginning a new one (same CA, new
    /// key) when the key's lifetime is over.
    fn generation_at(&self, now: OffsetDateTime) -> Result<Arc<Generation>, CertError> {
        let current = self.current();
        if now < current.retires && std::time::Instant::now() < current.retires_mono {
            return Ok(current);
        }
        let mut slot = self.current.write().unwrap_or_else(PoisonError::into_inner);
        // Another handshake may have renewed it while this one waited.
        if slot.id != current.id {
            return Ok(slot.clone());
        }
        let id = self.generations.fetch_add(1, Ordering::Relaxed) + 1;
        let next = Arc::new(Generation::new(
            id,
            current.ca.clone(),
            (now, self.config.key_lifetime),
        )?);
        *slot = next.clone();
        drop(slot);
        tracing::info!(
            generation = id,
            "leaf key lifetime over: a new leaf key signs from now on"
        );
        self.cache.invalidate_all();
        Ok(next)
    }

    fn mint(
        &self,
        name: &LeafName,
        generation: &Generation,
        now: OffsetDateTime,
    ) -> Result<Cached, CertError> {
        let err = |message: String| CertError::Mint {
            name: name.to_string(),
            message,
        };
        let mut params = leaf_params(name).map_err(|e| err(e.to_string()))?;
        params.not_before = now - self.config.backdate;
        // Never past the CA's own end: a client would refuse the chain.
        params.not_after = (now + self.config.validity).min(generation.ca.not_after());
        let (not_before, not_after) = (params.not_before, params.not_after);
        let mut serial = [0u8; 16];
        self.rng
            .fill(&mut serial)
            .map_err(|_| err("no randomness for the serial number".into()))?;
        serial[0] &= 0x7f; // positive, as RFC 5280 requires
        serial[0] |= 0x01; // and sixteen bytes long
        params.serial_number = Some(SerialNumber::from_slice(&serial));
        let cert = params
            .signed_by(&generation.key, generation.ca.issuer())
            .map_err(|e| err(e.to_string()))?;
        self.minted.fetch_add(1, Ordering::Relaxed);
        let mut chain = Vec::with_capacity(1 + generation.ca.chain().len());
        chain.push(cert.der().clone());
        chain.extend(generation.ca.chain().iter().cloned());
        Ok(Cached {
            generation: generation.id,
            leaf: Arc::new(CertifiedKey::new(chain, generation.signer.clone())),
            not_before,
            not_after,
        })
    }
}

/// A leaf's names and usages (validity and serial are the minter's).
fn leaf_params(name: &LeafName) -> Result<CertificateParams, rcgen::Error> {
    let mut params = CertificateParams::default();
    // The default subject is rcgen's placeholder name: a name too long for a
    // commonName leaves the subject empty (its SAN then critical).
    params.distinguished_name = DistinguishedName::new();
    match name {
        LeafName::Dns(h) => {
            params.subject_alt_names = vec![SanType::DnsName(h.as_str().try_into()?)];
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
    Ok(params)
}

// === impl Generation ===

impl Generation {
    /// Made at `now`, signing for `lifetime` (on both clocks).
    fn new(
        id: u64,
        ca: Arc<CertificateAuthority>,
        (now, lifetime): (OffsetDateTime, Duration),
    ) -> Result<Self, CertError> {
        let err = |message: String| CertError::Mint {
            name: "the leaf key".into(),
            message,
        };
        let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).map_err(|e| err(e.to_string()))?;
        let der = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        let signer = any_ecdsa_type(&der).map_err(|e| err(e.to_string()))?;
        let retires = now + lifetime;
        let retires_mono = std::time::Duration::try_from(lifetime)
            .ok()
            .and_then(|d| std::time::Instant::now().checked_add(d))
            .unwrap_or_else(std::time::Instant::now);
        Ok(Self {
            id,
            ca,
            key,
            signer,
            retires,
            retires_mono,
        })
    }
}

impl fmt::Debug for LeafMinter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeafMinter")
            .field("ca", &self.ca())
            .field("config", &self.config)
            .field("minted", &self.minted())
            .finish_non_exhaustive()
    }
}
