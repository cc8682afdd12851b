//! A worker's intermediate CA under a fleet root, made without the worker's
//! key leaving the worker.
//!
//! [`request`] runs on the worker: it makes (or keeps) the key and writes a
//! certificate signing request, which carries only a name and the public key.
//! [`sign_intermediate`] runs where the root lives: it checks the request's
//! signature and refuses one that asks for anything (a CA bit, names, usages)
//! — what an intermediate may do is the signer's decision, not the
//! requester's — and issues a CA certificate with pathLen 0 (it signs leaves,
//! never another CA), valid for the asked time but never past the root.

use std::fs;
use std::path::{Path, PathBuf};

use aws_lc_rs::rand::{SecureRandom, SystemRandom};
use rcgen::{
    BasicConstraints, CertificateParams, CertificateSigningRequestParams, DnType, IsCa, KeyPair,
    KeyUsagePurpose, SerialNumber, PKCS_ECDSA_P256_SHA256, PKCS_ECDSA_P384_SHA384,
};
use time::{Duration, OffsetDateTime};

use crate::ca::{read_private, write_new};
use crate::{CertError, CertificateAuthority, CA_KEY_FILE};

/// File name of a worker's signing request in its CA directory.
pub const CA_CSR_FILE: &str = "ca.csr";

/// How long an intermediate is valid unless asked otherwise: a year, so
/// renewing it is a yearly routine rather than a decade's surprise.
pub const DEFAULT_INTERMEDIATE_VALIDITY: Duration = Duration::days(365);

/// A signed intermediate.
#[derive(Clone, Debug)]
pub struct Signed {
    /// The intermediate, then the signer's certificates as its file holds
    /// them: what the worker's `tls.ca_cert` holds.
    pub chain_pem: String,
    pub not_after: OffsetDateTime,
    /// The asked validity ran past the root's `notAfter` and was cut there.
    pub clamped: bool,
}

/// Writes `dir/ca.csr` for `dir/ca.key`, making the key (ECDSA P-256, mode
/// 0600) when there is none; an existing key is kept, never overwritten, so
/// a renewal can request a new certificate for the same key. Returns the
/// request's path.
pub fn request(dir: &Path, common_name: &str) -> Result<PathBuf, CertError> {
    let key_path = dir.join(CA_KEY_FILE);
    let csr_path = dir.join(CA_CSR_FILE);
    let failed = |path: &Path, e: rcgen::Error| CertError::Invalid {
        path: path.to_owned(),
        message: e.to_string(),
    };
    let key = if key_path.exists() {
        crate::ca::key_from_pem(&key_path, &read_private(&key_path)?)?
    } else {
        fs::create_dir_all(dir).map_err(|source| CertError::Io {
            path: dir.to_owned(),
            source,
        })?;
        let key =
            KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).map_err(|e| failed(&key_path, e))?;
        write_new(&key_path, key.serialize_pem().as_bytes(), 0o600)?;
        key
    };
    let mut params = CertificateParams::default();
    crate::ca::name_ca(&mut params, common_name);
    let pem = params
        .serialize_request(&key)
        .and_then(|csr| csr.pem())
        .map_err(|e| failed(&csr_path, e))?;
    fs::write(&csr_path, pem).map_err(|source| CertError::Io {
        path: csr_path.clone(),
        source,
    })?;
    Ok(csr_path)
}

/// Issues an intermediate CA certificate for the request in `csr_pem`
/// (read from `csr_path`, named in errors) under `root`, valid from `now`
/// for `validity` or until the root's `notAfter`, whichever comes first.
pub fn sign_intermediate(
    root: &CertificateAuthority,
    csr_path: &Path,
    csr_pem: &str,
    validity: Duration,
    now: OffsetDateTime,
) -> Result<Signed, CertError> {
    let refuse = |message: String| CertError::Invalid {
        path: csr_path.to_owned(),
        message,
    };
    if validity <= Duration::ZERO {
        return Err(refuse(format!("a validity of {validity} is not positive")));
    }
    may_issue_cas(root)?;
    let csr =
        CertificateSigningRequestParams::from_pem(csr_pem).map_err(|e| refuse(csr_error(&e)))?;
    plain_request(&csr).map_err(refuse)?;
    let mut params = CertificateParams::default();
    params.distinguished_name = csr.params.distinguished_name.clone();
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    params.use_authority_key_identifier_extension = true;
    params.not_before = now - Duration::hours(1);
    // Past the year 9999 `+` would panic: such an ask is cut like any other
    // that outlives the root.
    let asked = now.checked_add(validity);
    let clamped = asked.is_none_or(|asked| asked > root.not_after());
    params.not_after = asked.map_or(root.not_after(), |asked| asked.min(root.not_after()));
    params.serial_number = Some(serial().map_err(refuse)?);
    let not_after = params.not_after;
    let cert = CertificateSigningRequestParams {
        params,
        public_key: csr.public_key,
    }
    .signed_by(root.issuer())
    .map_err(|e| refuse(format!("cannot sign: {e}")))?;
    Ok(Signed {
        chain_pem: format!("{}{}", cert.pem(), root.cert_pem()),
        not_after,
        clamped,
    })
}

/// The signer's basicConstraints must let it issue a CA: pathLen absent or
/// at least 1. (The gateway's own CA has pathLen 0: it signs leaves only.)
fn may_issue_cas(root: &CertificateAuthority) -> Result<(), CertError> {
    let refuse = |message: String| CertError::Invalid {
        path: root.paths().cert.clone(),
        message,
    };
    let (_, cert) = x509_parser::parse_x509_certificate(root.cert_der())
        .map_err(|e| refuse(format!("not valid X.509: {e}")))?;
    let path_len = cert
        .basic_constraints()
        .ok()
        .flatten()
        .and_then(|bc| bc.value.path_len_constraint);
    if path_len == Some(0) {
        return Err(refuse(
            "its basicConstraints pathLen is 0: it may sign leaves but not a worker's CA; make a fleet root with `egress-gateway ca init --root`".into(),
        ));
    }
    Ok(())
}

/// One sentence for why rcgen refused a request.
fn csr_error(e: &rcgen::Error) -> String {
    match e {
        rcgen::Error::CouldNotParseCertificationRequest => {
            "not a PEM certificate signing request".into()
        }
        rcgen::Error::InvalidCertificationRequestSignature => {
            "the request's signature does not verify: it was altered or is corrupt".into()
        }
        rcgen::Error::UnsupportedExtension => {
            "the request asks for an extension the signer does not grant".into()
        }
        other => format!("unusable request: {other}"),
    }
}

/// A worker's request carries a name and a key, nothing else.
fn plain_request(csr: &CertificateSigningRequestParams) -> Result<(), String> {
    let p = &csr.params;
    let asked = [
        (!matches!(p.is_ca, IsCa::NoCa), "basicConstraints"),
        (!p.subject_alt_names.is_empty(), "subject alternative names"),
        (!p.key_usages.is_empty(), "key usages"),
        (!p.extended_key_usages.is_empty(), "extended key usages"),
    ];
    if let Some((_, what)) = asked.iter().find(|(yes, _)| *yes) {
        return Err(format!(
            "the request asks for {what}; a worker's request carries only a name and a key (`egress-gateway ca request` makes one), and the signer decides what the CA may do"
        ));
    }
    if p.distinguished_name.get(&DnType::CommonName).is_none() {
        return Err("the request's subject has no commonName".into());
    }
    let alg = csr.public_key.algorithm();
    if alg != &PKCS_ECDSA_P256_SHA256 && alg != &PKCS_ECDSA_P384_SHA384 {
        return Err(format!(
            "the request is signed with {alg:?}; only ECDSA P-256 and P-384 keys are signed"
        ));
    }
    Ok(())
}

/// A random positive 16-byte serial number.
fn serial() -> Result<SerialNumber, String> {
    let mut serial = [0u8; 16];
    SystemRandom::new()
        .fill(&mut serial)
        .map_err(|_| "no randomness for the serial number".to_owned())?;
    serial[0] &= 0x7f;
    serial[0] |= 0x01;
    Ok(SerialNumber::from_slice(&serial))
}
