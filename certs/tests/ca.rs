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

/// A fleet root kept as one file, its key (in any form) beside its
/// certificate: it loads as before, and `ca sign` hands on the file's
/// certificates alone, never the key, after a worker's intermediate. A key
/// file is read from its first key section, whatever comes before it
/// (OpenSSL's `EC PARAMETERS`).
#[test]
fn a_root_kept_with_its_key_never_hands_the_key_on_and_a_key_after_parameters_is_read() {
    let dir = tempfile::tempdir().expect("temp dir");
    let root = CertificateAuthority::create_root(&dir.path().join("root")).expect("root");
    let key = fs::read_to_string(&root.paths().key).expect("key");
    let encrypted =
        "-----BEGIN ENCRYPTED PRIVATE KEY-----\nAAAA\n-----END ENCRYPTED PRIVATE KEY-----\n";
    let both = dir.path().join("root.pem");
    fs::write(&both, format!("{key}{}{encrypted}", root.cert_pem())).expect("write");
    chmod(&both, 0o600);
    let combined = CaPaths {
        cert: both.clone(),
        key: both.clone(),
    };
    // Its key beside its certificate, the certificate file readable by
    // others: refused, as the key file would be.
    let open_copy = dir.path().join("root-open.pem");
    fs::copy(&both, &open_copy).expect("copy");
    chmod(&open_copy, 0o644);
    let open = CaPaths {
        cert: open_copy,
        key: root.paths().key.clone(),
    };
    let err = CertificateAuthority::load(&open).expect_err("a key others can read");
    assert!(matches!(err, CertError::KeyPermissions { .. }), "{err}");
    let loaded = CertificateAuthority::load(&combined).expect("a root kept with its key");
    assert_eq!(loaded.cert_pem(), root.cert_pem(), "its certificate alone");
    let worker = dir.path().join("worker");
    let csr = egress_certs::request(&worker, "worker-7").expect("request");
    let pem = fs::read_to_string(&csr).expect("csr");
    let signed = egress_certs::sign_intermediate(
        &loaded,
        &csr,
        &pem,
        time::Duration::days(30),
        time::OffsetDateTime::now_utc(),
    )
    .expect("signed");
    assert!(
        !signed.chain_pem.contains("PRIVATE KEY"),
        "the root's key went into the chain: {}",
        signed.chain_pem
    );
    assert!(signed.chain_pem.ends_with(root.cert_pem()));
    let parameters =
        "-----BEGIN EC PARAMETERS-----\nBggqhkjOPQMBBw==\n-----END EC PARAMETERS-----\n";
    fs::write(&root.paths().key, format!("{parameters}{key}")).expect("write");
    chmod(&root.paths().key, 0o600);
    CertificateAuthority::load(root.paths()).expect("the key after its parameters");
}

/// A CA whose extensions forbid what the gateway signs under it is refused
/// at load, naming the field: OpenSSL's clients would refuse every leaf.
#[test]
fn a_ca_constrained_against_server_leaves_is_refused() {
    use rcgen::{
        BasicConstraints, CertificateParams, ExtendedKeyUsagePurpose, IsCa, KeyPair,
        KeyUsagePurpose,
    };
    let dir = tempfile::tempdir().expect("temp dir");
    let ca = |name: &str, usages: Vec<KeyUsagePurpose>, extended: Vec<ExtendedKeyUsagePurpose>| {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("params");
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = usages;
        params.extended_key_usages = extended;
        let key = KeyPair::generate().expect("key");
        let cert = params.self_signed(&key).expect("signed");
        let at = dir.path().join(name);
        fs::create_dir(&at).expect("dir");
        let paths = CaPaths::in_dir(&at);
        fs::write(&paths.cert, cert.pem()).expect("cert");
        fs::write(&paths.key, key.serialize_pem()).expect("key");
        chmod(&paths.key, 0o600);
        paths
    };
    let sign = || {
        vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::DigitalSignature,
        ]
    };
    for (paths, field) in [
        (
            ca(
                "no-cert-sign",
                vec![KeyUsagePurpose::DigitalSignature],
                vec![],
            ),
            "keyCertSign",
        ),
        (
            ca(
                "client-only",
                sign(),
                vec![ExtendedKeyUsagePurpose::ClientAuth],
            ),
            "serverAuth",
        ),
    ] {
        let err = CertificateAuthority::load(&paths).expect_err(field);
        assert!(err.to_string().contains(field), "{err}");
    }
    let fine = ca("servers", sign(), vec![ExtendedKeyUsagePurpose::ServerAuth]);
    CertificateAuthority::load(&fine).expect("a CA for servers");
    // An intermediate under a root of pathLen 0: the root may issue leaves
    // only, so no client takes a leaf under the intermediate.
    let ca_params = |name: &str, constraint| {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("params");
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, name);
        params.is_ca = IsCa::Ca(constraint);
        params.key_usages = sign();
        params
    };
    let root_params = ca_params("root", BasicConstraints::Constrained(0));
    let root_key = KeyPair::generate().expect("key");
    let root = root_params.self_signed(&root_key).expect("root");
    let worker_key = KeyPair::generate().expect("key");
    let issuer = rcgen::Issuer::from_params(&root_params, &root_key);
    let worker = ca_params("worker", BasicConstraints::Unconstrained)
        .signed_by(&worker_key, &issuer)
        .expect("worker");
    let paths = fine;
    fs::write(&paths.cert, format!("{}{}", worker.pem(), root.pem())).expect("chain");
    fs::write(&paths.key, worker_key.serialize_pem()).expect("key");
    let err = CertificateAuthority::load(&paths).expect_err("pathLen");
    assert!(
        err.to_string().contains("certificate 2 of 2") && err.to_string().contains("pathLen is 0"),
        "{err}"
    );
}

/// A leaf for a name too long for a commonName has no subject name at all,
/// not rcgen's placeholder; a shorter one is named by it.
#[test]
fn a_leaf_is_named_only_by_its_name() {
    let dir = tempfile::tempdir().expect("temp dir");
    let ca = Arc::new(CertificateAuthority::create(dir.path()).expect("created"));
    let m = LeafMinter::new(ca, MintConfig::default()).expect("minter");
    let long = format!("{}.example.test", "a".repeat(60));
    for (name, cn) in [
        (long.as_str(), None),
        ("b.example.test", Some("b.example.test")),
    ] {
        let leaf = m
            .leaf(&LeafName::Dns(Hostname::parse(name).expect("valid")))
            .expect("minted");
        let (_, cert) = x509_parser::parse_x509_certificate(leaf.cert[0].as_ref()).expect("parses");
        let names: Vec<&str> = cert
            .subject()
            .iter_common_name()
            .filter_map(|c| c.as_str().ok())
            .collect();
        assert_eq!(names, cn.into_iter().collect::<Vec<_>>(), "{name}");
        assert_eq!(
            cert.subject().iter().count(),
            usize::from(cn.is_some()),
            "{name}"
        );
    }
}

/// A CA's files are written whole under their names or not at all: what a
/// crash left (a temporary file) does not stop the next create, and a
/// create leaves nothing but the two files beside it.
#[test]
fn a_ca_is_created_whole_over_what_a_crash_left() {
    let dir = tempfile::tempdir().expect("temp dir");
    let at = dir.path().join("ca");
    fs::create_dir(&at).expect("dir");
    // What a crash of a process with this PID left (a container's PID 1
    // has the same PID at every start): the names this one would try.
    let left: Vec<String> = (0..200)
        .map(|n| format!(".{CA_KEY_FILE}.{}.{n}.tmp", std::process::id()))
        .collect();
    for name in &left {
        fs::write(at.join(name), "-----BEGIN PRIV").expect("left");
    }
    let ca = CertificateAuthority::load_or_create(&at).expect("created");
    let mut names: Vec<String> = fs::read_dir(&at)
        .expect("list")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .filter(|n| !left.contains(n))
        .collect();
    names.sort();
    assert_eq!(names, vec![CA_CERT_FILE.to_owned(), CA_KEY_FILE.to_owned()]);
    assert_eq!(
        fs::metadata(&ca.paths().key)
            .expect("key")
            .permissions()
            .mode()
            & 0o777,
        0o600
    );
    let err = CertificateAuthority::create(&at).expect_err("exists");
    assert!(matches!(err, CertError::Exists { .. }), "{err}");
}
