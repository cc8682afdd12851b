//! Loading and creating the interception CA.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::sync::Arc;

use egress_certs::{
    CaPaths, CertError, CertificateAuthority, LeafMinter, LeafName, MintConfig, CA_CERT_FILE,
    CA_KEY_FILE,
};
use egress_policy::Hostname;

fn chmod(path: &std::path::Path, mode: u32) {
    fs::set_permissions(path, fs::Permissions::from_mode(mode)).expect("chmod");
}

#[test]
fn create_writes_a_private_key_and_a_ca_certificate() {
    let dir = tempfile::tempdir().expect("temp dir");
    let ca = CertificateAuthority::create(&dir.path().join("ca")).expect("created");
    let paths = ca.paths().clone();
    assert_eq!(paths, CaPaths::in_dir(&dir.path().join("ca")));
    assert_eq!(
        fs::metadata(&paths.key).expect("key").permissions().mode() & 0o777,
        0o600
    );
    let pem = fs::read_to_string(&paths.cert).expect("cert");
    assert_eq!(pem, ca.cert_pem());
    let (_, cert) = x509_parser::parse_x509_certificate(ca.cert_der().as_ref()).expect("parses");
    assert!(cert.is_ca());
    let ku = cert
        .key_usage()
        .expect("ext")
        .expect("key usage present")
        .value;
    assert!(ku.key_cert_sign());
    let years = (cert.validity().not_after.timestamp() - cert.validity().not_before.timestamp())
        / (365 * 86400);
    assert!(years >= 9, "long-lived: {years} years");
    assert_eq!(
        cert.public_key().algorithm.algorithm.to_id_string(),
        "1.2.840.10045.2.1",
        "EC public key"
    );
}

#[test]
fn create_refuses_to_overwrite_and_load_or_create_reuses() {
    let dir = tempfile::tempdir().expect("temp dir");
    let first = CertificateAuthority::load_or_create(dir.path()).expect("created");
    let again = CertificateAuthority::load_or_create(dir.path()).expect("loaded");
    assert_eq!(
        first.cert_der(),
        again.cert_der(),
        "the same CA, not a new one"
    );
    let err = CertificateAuthority::create(dir.path()).expect_err("exists");
    assert!(matches!(err, CertError::Exists { .. }), "{err}");
}

#[test]
fn a_loaded_ca_signs_leaves_that_chain_to_it() {
    let dir = tempfile::tempdir().expect("temp dir");
    let created = CertificateAuthority::create(dir.path()).expect("created");
    let loaded = Arc::new(CertificateAuthority::load(created.paths()).expect("loaded"));
    let m = LeafMinter::new(loaded, MintConfig::default()).expect("minter");
    let leaf = m
        .leaf(&LeafName::Dns(
            Hostname::parse("a.example.test").expect("valid"),
        ))
        .expect("minted");
    let (_, cert) = x509_parser::parse_x509_certificate(leaf.cert[0].as_ref()).expect("parses");
    let (_, ca) = x509_parser::parse_x509_certificate(created.cert_der().as_ref()).expect("parses");
    assert_eq!(cert.issuer(), ca.subject());
    cert.verify_signature(Some(ca.public_key()))
        .expect("signed by the CA's key");
}

#[test]
fn refuses_a_key_readable_by_group_or_others() {
    let dir = tempfile::tempdir().expect("temp dir");
    let paths = CertificateAuthority::create(dir.path())
        .expect("created")
        .paths()
        .clone();
    for mode in [0o644, 0o640, 0o604, 0o660] {
        chmod(&paths.key, mode);
        let err = CertificateAuthority::load(&paths).expect_err("readable key");
        assert!(
            matches!(err, CertError::KeyPermissions { mode: m, .. } if m == mode),
            "{mode:o}: {err}"
        );
        let shown = err.to_string();
        assert!(
            shown.contains(paths.key.to_str().expect("utf-8")) && shown.contains("chmod 600"),
            "{shown}"
        );
    }
    chmod(&paths.key, 0o400);
    CertificateAuthority::load(&paths).expect("owner-only key loads");
}

#[test]
fn refuses_half_a_ca_a_foreign_key_a_leaf_and_garbage() {
    let dir = tempfile::tempdir().expect("temp dir");
    let a = CertificateAuthority::create(&dir.path().join("a")).expect("a");
    let b = CertificateAuthority::create(&dir.path().join("b")).expect("b");

    let half = dir.path().join("half");
    fs::create_dir(&half).expect("dir");
    fs::copy(&a.paths().cert, half.join(CA_CERT_FILE)).expect("copy");
    let err = CertificateAuthority::load_or_create(&half).expect_err("half");
    assert!(err.to_string().contains(CA_KEY_FILE), "{err}");

    let mixed = CaPaths {
        cert: a.paths().cert.clone(),
        key: b.paths().key.clone(),
    };
    let err = CertificateAuthority::load(&mixed).expect_err("foreign key");
    assert!(err.to_string().contains("does not belong"), "{err}");

    // A certificate that is not a CA, with its own (private) key.
    let not_ca =
        rcgen::generate_simple_self_signed(vec!["x.test".to_owned()]).expect("self-signed");
    let leaf = CaPaths {
        cert: dir.path().join("leaf.crt"),
        key: dir.path().join("leaf.key"),
    };
    fs::write(&leaf.cert, not_ca.cert.pem()).expect("write");
    fs::write(&leaf.key, not_ca.signing_key.serialize_pem()).expect("write");
    chmod(&leaf.key, 0o600);
    let err = CertificateAuthority::load(&leaf).expect_err("not a CA");
    assert!(err.to_string().contains("not a CA certificate"), "{err}");

    let garbage = dir.path().join("garbage.crt");
    fs::write(&garbage, "not a certificate").expect("write");
    let err = CertificateAuthority::load(&CaPaths {
        cert: garbage.clone(),
        key: b.paths().key.clone(),
    })
    .expect_err("garbage");
    assert!(
        err.to_string().contains(garbage.to_str().expect("utf-8")),
        "{err}"
    );

    let missing = CaPaths {
        cert: dir.path().join("nope.crt"),
        key: dir.path().join("nope.key"),
    };
    let err = CertificateAuthority::load(&missing).expect_err("missing");
    assert!(err.to_string().contains("nope.key"), "{err}");
}
