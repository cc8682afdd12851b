//! The interception CA: load from PEM (one CA, or a worker's intermediate
//! with the chain above it; `chain.rs` says what is accepted), or create.

use std::fs;
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose,
    PKCS_ECDSA_P256_SHA256,
};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use time::{Duration, OffsetDateTime};

use crate::CertError;

/// File name of the CA certificate in a CA directory.
pub const CA_CERT_FILE: &str = "ca.crt";
/// File name of the CA private key in a CA directory.
pub const CA_KEY_FILE: &str = "ca.key";

/// The subject common name of a CA the gateway creates.
pub const DEFAULT_COMMON_NAME: &str = "egress-gateway interception CA";

/// The subject common name of a fleet root `ca init --root` creates.
pub const ROOT_COMMON_NAME: &str = "egress-gateway fleet root";

/// Ten years: the CA is installed in sandbox images, so it should outlive them.
const CA_VALIDITY: Duration = Duration::days(3650);

/// Where a CA's certificate and key live.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CaPaths {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// A CA that can sign leaves.
pub struct CertificateAuthority {
    issuer: Issuer<'static, KeyPair>,
    /// The first certificate in the file: the one whose key signs.
    cert_der: CertificateDer<'static>,
    /// What follows a minted leaf in a handshake (`cert_der` first).
    chain: Vec<CertificateDer<'static>>,
    cert_pem: String,
    paths: CaPaths,
    not_after: OffsetDateTime,
    subject: String,
    fingerprint: String,
}

impl std::fmt::Debug for CertificateAuthority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CertificateAuthority")
            .field("paths", &self.paths)
            .finish_non_exhaustive()
    }
}

// === impl CaPaths ===

impl CaPaths {
    /// `dir/ca.crt` and `dir/ca.key`.
    pub fn in_dir(dir: &Path) -> Self {
        Self {
            cert: dir.join(CA_CERT_FILE),
            key: dir.join(CA_KEY_FILE),
        }
    }
}

// === impl CertificateAuthority ===

impl CertificateAuthority {
    /// Loads a CA from PEM files. Refuses a key readable by group or others,
    /// a certificate that is not a CA, a key that does not match the first
    /// certificate, and a chain whose certificates do not each issue the one
    /// before (see `chain.rs`).
    pub fn load(paths: &CaPaths) -> Result<Self, CertError> {
        Self::load_at(paths, OffsetDateTime::now_utc())
    }

    /// [`CertificateAuthority::load`], refusing certificates expired at `now`.
    pub fn load_at(paths: &CaPaths, now: OffsetDateTime) -> Result<Self, CertError> {
        let key_pem = read_private(&paths.key)?;
        let cert_pem = fs::read_to_string(&paths.cert).map_err(|source| CertError::Io {
            path: paths.cert.clone(),
            source,
        })?;
        let invalid = |path: &Path, message: String| CertError::Invalid {
            path: path.to_owned(),
            message,
        };
        let key = key_from_pem(&paths.key, &key_pem)?;
        // A root kept with its key in one file: the file is a key's, and
        // held to a key's mode.
        if PrivateKeyDer::from_pem_slice(cert_pem.as_bytes()).is_ok() && paths.cert != paths.key {
            read_private(&paths.cert)?;
        }
        let certs = CertificateDer::pem_slice_iter(cert_pem.as_bytes())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| invalid(&paths.cert, format!("no PEM certificate: {e}")))?;
        // The file's certificates alone, written again: whatever else it
        // holds (a root's key kept in the same file, in any form) is never
        // handed on (`ca sign` puts this after every worker's intermediate).
        let cert_pem: String = certs.iter().map(pem_certificate).collect();
        let chain = crate::chain::check(&certs, &key, now).map_err(|m| invalid(&paths.cert, m))?;
        let cert_der = chain.served[0].clone();
        let issuer = Issuer::from_ca_cert_der(&cert_der, key)
            .map_err(|e| invalid(&paths.cert, format!("cannot sign with this CA: {e}")))?;
        Ok(Self {
            issuer,
            fingerprint: fingerprint(&cert_der),
            cert_der,
            chain: chain.served,
            cert_pem,
            paths: paths.clone(),
            not_after: chain.not_after,
            subject: chain.subject,
        })
    }

    /// Creates a new CA in `dir` (made if missing), refusing to overwrite one.
    pub fn create(dir: &Path) -> Result<Self, CertError> {
        Self::create_named(dir, DEFAULT_COMMON_NAME)
    }

    /// [`CertificateAuthority::create`] with another subject common name
    /// (test CAs for fake origins must not look like the gateway's).
    pub fn create_named(dir: &Path, common_name: &str) -> Result<Self, CertError> {
        Self::create_with(dir, common_name, 0)
    }

    /// A fleet root in `dir`: as [`CertificateAuthority::create`], but with
    /// pathLen 1, so it can issue each worker's intermediate (`ca sign`).
    pub fn create_root(dir: &Path) -> Result<Self, CertError> {
        Self::create_with(dir, ROOT_COMMON_NAME, 1)
    }

    fn create_with(dir: &Path, common_name: &str, path_len: u8) -> Result<Self, CertError> {
        let paths = CaPaths::in_dir(dir);
        for path in [&paths.cert, &paths.key] {
            if path.exists() {
                return Err(CertError::Exists { path: path.clone() });
            }
        }
        fs::create_dir_all(dir).map_err(|source| CertError::Io {
            path: dir.to_owned(),
            source,
        })?;
        let mint_err = |e: rcgen::Error| CertError::Mint {
            name: "the CA".into(),
            message: e.to_string(),
        };
        let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).map_err(mint_err)?;
        let mut params = CertificateParams::default();
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(path_len));
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        name_ca(&mut params, common_name);
        let now = OffsetDateTime::now_utc();
        params.not_before = now - Duration::hours(1);
        params.not_after = now + CA_VALIDITY;
        let cert = params.self_signed(&key).map_err(mint_err)?;
        // Key first and private from its first byte: a crash between the two
        // writes leaves a half-present CA, which `load_or_create` reports.
        write_new(&paths.key, key.serialize_pem().as_bytes(), 0o600)?;
        write_new(&paths.cert, cert.pem().as_bytes(), 0o644)?;
        tracing::info!(cert = %paths.cert.display(), "created interception CA");
        Self::load(&paths)
    }

    /// Loads the CA in `dir`, creating one when neither file exists.
    pub fn load_or_create(dir: &Path) -> Result<Self, CertError> {
        Self::load_or_create_named(dir, DEFAULT_COMMON_NAME)
    }

    /// [`CertificateAuthority::load_or_create`] with a common name for a new CA.
    pub fn load_or_create_named(dir: &Path, common_name: &str) -> Result<Self, CertError> {
        let paths = CaPaths::in_dir(dir);
        match (paths.cert.exists(), paths.key.exists()) {
            (true, true) => Self::load(&paths),
            (false, false) => Self::create_named(dir, common_name),
            (true, false) => Err(CertError::HalfPresent {
                dir: dir.to_owned(),
                present: CA_CERT_FILE,
                missing: CA_KEY_FILE,
            }),
            (false, true) => Err(CertError::HalfPresent {
                dir: dir.to_owned(),
                present: CA_KEY_FILE,
                missing: CA_CERT_FILE,
            }),
        }
    }

    pub fn paths(&self) -> &CaPaths {
        &self.paths
    }

    /// The certificate sandboxes must trust, as PEM.
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// The first certificate in the file: the CA that signs leaves.
    pub fn cert_der(&self) -> &CertificateDer<'static> {
        &self.cert_der
    }

    /// What follows every minted leaf in a handshake: the signing CA, then
    /// any intermediates above it (never a root).
    pub fn chain(&self) -> &[CertificateDer<'static>] {
        &self.chain
    }

    /// The earliest `notAfter` of the certificates in the file.
    pub fn not_after(&self) -> OffsetDateTime {
        self.not_after
    }

    /// The signing CA's subject (RFC 4514 text).
    pub fn subject(&self) -> &str {
        &self.subject
    }

    /// SHA-256 of the signing CA's certificate, as colon-separated hex (the
    /// form `openssl x509 -fingerprint -sha256` prints).
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    pub(crate) fn issuer(&self) -> &Issuer<'static, KeyPair> {
        &self.issuer
    }
}

/// The subject of a CA the gateway makes (or asks to be signed): a common
/// name and the organization `egress-gateway`.
pub(crate) fn name_ca(params: &mut CertificateParams, common_name: &str) {
    params
        .distinguished_name
        .push(DnType::CommonName, common_name);
    params
        .distinguished_name
        .push(DnType::OrganizationName, "egress-gateway");
}

/// The key of a key file's first private-key section (`PRIVATE KEY`, `RSA
/// PRIVATE KEY`, `EC PRIVATE KEY`), whatever comes before it: OpenSSL writes
/// `EC PARAMETERS` first.
pub(crate) fn key_from_pem(path: &Path, pem: &str) -> Result<KeyPair, CertError> {
    let invalid = |message: String| CertError::Invalid {
        path: path.to_owned(),
        message,
    };
    let der = PrivateKeyDer::from_pem_slice(pem.as_bytes()).map_err(|e| {
        invalid(format!(
            "no private key section (PRIVATE KEY, RSA PRIVATE KEY or EC PRIVATE KEY): {e}"
        ))
    })?;
    KeyPair::try_from(&der).map_err(|e| invalid(format!("not a usable private key: {e}")))
}

/// A certificate as PEM (64 characters a line, as OpenSSL writes it).
fn pem_certificate(der: &CertificateDer<'_>) -> String {
    use base64::Engine as _;
    let text = base64::engine::general_purpose::STANDARD.encode(der.as_ref());
    let mut pem = String::from("-----BEGIN CERTIFICATE-----\n");
    for line in text.as_bytes().chunks(64) {
        pem.push_str(std::str::from_utf8(line).unwrap_or_default());
        pem.push('\n');
    }
    pem.push_str("-----END CERTIFICATE-----\n");
    pem
}

/// Reads a private key file, refusing one that group or others can read.
/// The mode checked is the open file's, the one read: a file moved into
/// place between a check by name and the read would be read unchecked.
pub(crate) fn read_private(path: &Path) -> Result<String, CertError> {
    use std::io::Read;
    let io = |source| CertError::Io {
        path: path.to_owned(),
        source,
    };
    let mut file = fs::File::open(path).map_err(io)?;
    let mode = file.metadata().map_err(io)?.permissions().mode() & 0o7777;
    if mode & 0o077 != 0 {
        return Err(CertError::KeyPermissions {
            path: path.to_owned(),
            mode,
        });
    }
    let mut text = String::new();
    file.read_to_string(&mut text).map_err(io)?;
    Ok(text)
}

fn fingerprint(der: &CertificateDer<'_>) -> String {
    let digest = aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, der);
    let hex: Vec<String> = digest.as_ref().iter().map(|b| format!("{b:02X}")).collect();
    hex.join(":")
}

/// Creates `path` (never overwriting) with `mode` from the start, whole or
/// not at all: written to a temporary file and synced, then linked to its
/// name (which fails if the name exists) and the directory synced. A crash
/// never leaves an empty or partial key or certificate under its name.
pub(crate) fn write_new(path: &Path, bytes: &[u8], mode: u32) -> Result<(), CertError> {
    let io = |at: &Path| {
        let at = at.to_owned();
        move |source| CertError::Io { path: at, source }
    };
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    // A name of its own, never another writer's: one a crash left (the same
    // PID, in a container where the gateway is PID 1) is passed over.
    let (tmp, mut f) = loop {
        let tmp = dir.join(format!(".{name}.{}.{}.tmp", std::process::id(), unique()));
        match fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(&tmp)
        {
            Ok(f) => break (tmp, f),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(io(&tmp)(e)),
        }
    };
    let written = f.write_all(bytes).and_then(|()| f.sync_all());
    let linked = written.and_then(|()| fs::hard_link(&tmp, path));
    let _ = fs::remove_file(&tmp);
    match linked {
        Ok(()) => {}
        // A file system without hard links: the name made at once, as
        // before (a crash may then leave it partial; the load says so).
        Err(e) if matches!(e.raw_os_error(), Some(code) if NO_LINKS.contains(&code)) => {
            let mut f = fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(mode)
                .open(path)
                .map_err(io(path))?;
            f.write_all(bytes)
                .and_then(|()| f.sync_all())
                .map_err(io(path))?;
        }
        Err(e) => return Err(io(path)(e)),
    }
    fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io(dir))
}

/// What `link(2)` answers on a file system that has no hard links:
/// EPERM (vfat, SMB), EOPNOTSUPP, ENOSYS.
const NO_LINKS: [i32; 3] = [1, 95, 38];

/// A number no other call of this process has had.
fn unique() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}
