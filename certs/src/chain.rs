//! What `tls.ca_cert` may hold, checked before a leaf is signed under it.
//!
//! Either one CA certificate (the gateway's own, self-signed, or a fleet CA
//! delivered to every worker), or a chain: the worker's intermediate first,
//! then further intermediates, then optionally the root. The first must be a
//! CA whose public key is the configured key's; each must be issued by the
//! next (names match and the signature verifies), so a client that trusts
//! the top of the chain verifies every leaf. A trailing self-signed root of a
//! longer chain is checked but not served: clients must already have it, and
//! sending it costs every handshake its bytes.

use rcgen::KeyPair;
use rustls_pki_types::CertificateDer;
use time::OffsetDateTime;
use x509_parser::certificate::X509Certificate;

/// A checked chain.
#[derive(Clone, Debug)]
pub(crate) struct Chain {
    /// What follows every minted leaf in a handshake: the first certificate
    /// and every further one but a trailing root.
    pub(crate) served: Vec<CertificateDer<'static>>,
    /// The earliest `notAfter` in the file: minted leaves stop verifying then.
    pub(crate) not_after: OffsetDateTime,
    /// The first certificate's subject, as RFC 4514 text.
    pub(crate) subject: String,
}

/// Why `cert`, with `below` CA certificates under it in the chain, cannot
/// be a CA in service at `now`: not a CA, expired, not valid yet, or
/// constrained so that clients refuse what is signed under it (every leaf
/// minted under it would fail every handshake).
fn in_service(cert: &X509Certificate<'_>, below: usize, now: OffsetDateTime) -> Result<(), String> {
    if !cert.is_ca() {
        return Err("not a CA certificate (basicConstraints CA is not set)".into());
    }
    may_sign_for_servers(cert, below)?;
    let validity = cert.validity();
    if validity.not_after.to_datetime() < now {
        return Err(format!("expired at {}", validity.not_after));
    }
    if validity.not_before.to_datetime() > now {
        return Err(format!(
            "not valid before {} (the clock of the machine that signed it, or this one's, is off)",
            validity.not_before
        ));
    }
    Ok(())
}

/// Refuses a CA whose extensions forbid what the gateway signs under it:
/// a keyUsage without keyCertSign, an extendedKeyUsage without serverAuth
/// (or anyExtendedKeyUsage), a pathLen below the CAs under it. OpenSSL's
/// clients check each; rustls' do not check all of them, so a chain that
/// passes this gateway's own tests could fail every other client.
fn may_sign_for_servers(cert: &X509Certificate<'_>, below: usize) -> Result<(), String> {
    let unreadable = |what: &str, e| format!("its {what} extension cannot be read: {e}");
    let usage = cert.key_usage().map_err(|e| unreadable("keyUsage", e))?;
    if usage.is_some_and(|u| !u.value.key_cert_sign()) {
        return Err("its keyUsage lacks keyCertSign: it may not sign certificates".into());
    }
    let extended = cert
        .extended_key_usage()
        .map_err(|e| unreadable("extendedKeyUsage", e))?;
    if extended.is_some_and(|x| !x.value.any && !x.value.server_auth) {
        return Err(
            "its extendedKeyUsage lacks serverAuth: clients refuse server certificates under it"
                .into(),
        );
    }
    let constraints = cert
        .basic_constraints()
        .map_err(|e| unreadable("basicConstraints", e))?;
    match constraints.and_then(|c| c.value.path_len_constraint) {
        Some(len) if (len as usize) < below => Err(format!(
            "its pathLen is {len}, but {below} CA certificate(s) come under it in the chain"
        )),
        _ => Ok(()),
    }
}

/// Checks `certs` (in file order) against `key` at `now`. The error is one
/// sentence naming the certificate by position and subject.
pub(crate) fn check(
    certs: &[CertificateDer<'static>],
    key: &KeyPair,
    now: OffsetDateTime,
) -> Result<Chain, String> {
    let parsed = certs
        .iter()
        .enumerate()
        .map(|(i, der)| {
            x509_parser::parse_x509_certificate(der)
                .map(|(_, c)| c)
                .map_err(|e| format!("certificate {}: not valid X.509: {e}", i + 1))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let Some(first) = parsed.first() else {
        return Err("no PEM certificate in the file".into());
    };
    if first.public_key().subject_public_key.data.as_ref() != key.public_key_raw() {
        return Err(
            "the private key does not belong to the first certificate (the worker's CA must come first)"
                .into(),
        );
    }
    let n = parsed.len();
    for (i, cert) in parsed.iter().enumerate() {
        let name = || format!("certificate {} of {n} ({})", i + 1, cert.subject());
        in_service(cert, i, now).map_err(|why| format!("{}: {why}", name()))?;
        if let Some(next) = parsed.get(i + 1) {
            issued_by(cert, next).map_err(|why| format!("{}: {why}", name()))?;
        }
    }
    let mut served = certs.to_vec();
    if n > 1 && parsed.last().is_some_and(self_signed) {
        served.pop();
    }
    let not_after = parsed
        .iter()
        .map(|c| c.validity().not_after.to_datetime())
        .min()
        .unwrap_or(now);
    Ok(Chain {
        served,
        not_after,
        subject: first.subject().to_string(),
    })
}

/// `cert` names `issuer` as its issuer and carries its signature.
fn issued_by(cert: &X509Certificate<'_>, issuer: &X509Certificate<'_>) -> Result<(), String> {
    if cert.issuer().as_raw() != issuer.subject().as_raw() {
        return Err(format!(
            "issued by {}, but the next certificate is {} (order: the worker's CA first, the root last)",
            cert.issuer(),
            issuer.subject()
        ));
    }
    cert.verify_signature(Some(issuer.public_key()))
        .map_err(|e| format!("its signature does not verify with the next certificate's key: {e}"))
}

fn self_signed(cert: &X509Certificate<'_>) -> bool {
    cert.issuer().as_raw() == cert.subject().as_raw() && cert.verify_signature(None).is_ok()
}
