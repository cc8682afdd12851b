//! One trust root for the fleet: a worker's request, the root's signature,
//! the chain loaded and served, and what is refused on the way; the leaf key
//! lifetime and CA replacement on an injected clock.

mod support;
use support::server;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use base64::Engine as _;
use egress_certs::{
    request, sign_intermediate, CaPaths, CertificateAuthority, LeafMinter, LeafName, LeafResolver,
    MintConfig, DEFAULT_INTERMEDIATE_VALIDITY,
};
use egress_policy::Hostname;
use rustls::pki_types::{CertificateDer, ServerName};
use rustls::{ClientConfig, RootCertStore};
use time::{Duration, OffsetDateTime};
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

/// A fleet root in `dir/root` and a worker intermediate in `dir/worker`
/// (`ca.crt` = intermediate then root, `ca.key` the worker's own).
fn fleet(dir: &Path) -> (CertificateAuthority, CaPaths) {
    let root = CertificateAuthority::create_root(&dir.join("root")).expect("root");
    let worker = dir.join("worker");
    let csr = request(&worker, "worker-1").expect("request");
    let pem = std::fs::read_to_string(&csr).expect("csr");
    let signed = sign_intermediate(
        &root,
        &csr,
        &pem,
        DEFAULT_INTERMEDIATE_VALIDITY,
        OffsetDateTime::now_utc(),
    )
    .expect("signed");
    assert!(!signed.clamped);
    let paths = CaPaths::in_dir(&worker);
    std::fs::write(&paths.cert, &signed.chain_pem).expect("write chain");
    (root, paths)
}

fn roots(trusted: &CertificateDer<'static>) -> Arc<ClientConfig> {
    let mut roots = RootCertStore::empty();
    roots.add(trusted.clone()).expect("root");
    Arc::new(
        ClientConfig::builder()
            .with_root_certificates(roots)
            .with_no_client_auth(),
    )
}

/// A verified handshake for `name`; the chain the server sent.
async fn handshake(
    addr: SocketAddr,
    config: Arc<ClientConfig>,
    name: &str,
) -> std::io::Result<Vec<CertificateDer<'static>>> {
    let tcp = TcpStream::connect(addr).await?;
    let name = ServerName::try_from(name.to_owned()).expect("name");
    let mut tls = TlsConnector::from(config).connect(name, tcp).await?;
    let mut buf = [0u8; 2];
    tls.read_exact(&mut buf).await?;
    assert_eq!(&buf, b"ok");
    Ok(tls.get_ref().1.peer_certificates().expect("chain").to_vec())
}

fn name(s: &str) -> LeafName {
    LeafName::Dns(Hostname::parse(s).expect("hostname"))
}

/// The subjectPublicKeyInfo of a leaf: which key it was minted for.
fn spki(der: &CertificateDer<'_>) -> Vec<u8> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).expect("x509");
    cert.public_key().raw.to_vec()
}

#[tokio::test]
async fn a_leaf_under_a_worker_intermediate_verifies_with_only_the_root_trusted() {
    let tmp = tempfile::tempdir().expect("temp");
    let (root, paths) = fleet(tmp.path());
    let ca = Arc::new(CertificateAuthority::load(&paths).expect("the chain loads"));
    assert_eq!(ca.chain().len(), 1, "the root in the file is not served");
    assert_ne!(ca.cert_der(), root.cert_der());
    assert!(ca.subject().contains("worker-1"), "{}", ca.subject());
    assert!(ca.not_after() <= root.not_after());
    let minter = Arc::new(LeafMinter::new(ca.clone(), MintConfig::default()).expect("minter"));
    let addr = server(LeafResolver::new(minter, None)).await;

    let chain = handshake(addr, roots(root.cert_der()), "api.example.test")
        .await
        .expect("a client trusting only the fleet root verifies the leaf");
    assert_eq!(chain.len(), 2, "[leaf, intermediate]");
    assert_eq!(&chain[1], ca.cert_der());

    let other = tempfile::tempdir().expect("temp");
    let (stranger, _) = fleet(other.path());
    assert!(
        handshake(addr, roots(stranger.cert_der()), "api.example.test")
            .await
            .is_err(),
        "another fleet's root does not verify it"
    );
}

#[test]
fn a_chain_that_does_not_hold_together_is_refused() {
    let tmp = tempfile::tempdir().expect("temp");
    let (root, paths) = fleet(tmp.path());
    let chain = std::fs::read_to_string(&paths.cert).expect("chain");
    let intermediate_pem = &chain[..chain.len() - root.cert_pem().len()];

    // The worker's key with another CA first.
    std::fs::write(&paths.cert, root.cert_pem()).expect("write");
    let err = CertificateAuthority::load(&paths).expect_err("wrong key");
    let shown = err.to_string();
    assert!(
        shown.contains(paths.cert.to_str().expect("utf-8")),
        "{shown}"
    );
    assert!(
        shown.contains("does not belong to the first certificate"),
        "{shown}"
    );

    // The intermediate followed by a root of the same name that did not sign it.
    let impostor = CertificateAuthority::create_root(&tmp.path().join("impostor")).expect("root");
    std::fs::write(
        &paths.cert,
        format!("{intermediate_pem}{}", impostor.cert_pem()),
    )
    .expect("write");
    let shown = CertificateAuthority::load(&paths)
        .expect_err("not issued by the next")
        .to_string();
    assert!(shown.contains("certificate 1 of 2"), "{shown}");
    assert!(shown.contains("signature does not verify"), "{shown}");

    // The intermediate followed by an unrelated CA of another name.
    let other = CertificateAuthority::create(&tmp.path().join("other")).expect("CA");
    std::fs::write(
        &paths.cert,
        format!("{intermediate_pem}{}", other.cert_pem()),
    )
    .expect("write");
    let shown = CertificateAuthority::load(&paths)
        .expect_err("names differ")
        .to_string();
    assert!(shown.contains("but the next certificate is"), "{shown}");

    // The intermediate alone loads: the root need not be in the file.
    std::fs::write(&paths.cert, intermediate_pem).expect("write");
    let ca = CertificateAuthority::load(&paths).expect("intermediate alone");
    assert_eq!(ca.chain().len(), 1);
    // Not yet valid here (signed on a machine whose clock runs a day
    // ahead): every leaf under it would fail, so it does not load.
    let shown =
        CertificateAuthority::load_at(&paths, OffsetDateTime::now_utc() - Duration::days(1))
            .expect_err("not yet valid")
            .to_string();
    assert!(shown.contains("not valid before"), "{shown}");
}

#[test]
fn sign_refuses_a_tampered_or_odd_request_and_a_leaf_only_signer() {
    let tmp = tempfile::tempdir().expect("temp");
    let root = CertificateAuthority::create_root(&tmp.path().join("root")).expect("root");
    let csr = request(&tmp.path().join("w"), "worker-1").expect("request");
    let pem = std::fs::read_to_string(&csr).expect("csr");
    let now = OffsetDateTime::now_utc();
    let sign = |pem: &str| sign_intermediate(&root, &csr, pem, Duration::days(30), now);

    // One byte of the subject changed: the signature no longer covers it.
    let body: String = pem.lines().filter(|l| !l.starts_with("-----")).collect();
    let mut der = base64::engine::general_purpose::STANDARD
        .decode(body)
        .expect("base64");
    let at = der
        .windows(8)
        .position(|w| w == b"worker-1")
        .expect("the name is in the request");
    der[at + 7] = b'2';
    let tampered = format!(
        "-----BEGIN CERTIFICATE REQUEST-----\n{}\n-----END CERTIFICATE REQUEST-----\n",
        base64::engine::general_purpose::STANDARD.encode(&der)
    );
    let shown = sign(&tampered).expect_err("tampered").to_string();
    assert!(shown.contains(csr.to_str().expect("utf-8")), "{shown}");
    assert!(shown.contains("signature does not verify"), "{shown}");

    // A request that asks to be a CA of its own making.
    let key = rcgen::KeyPair::generate().expect("key");
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "greedy");
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let greedy = params
        .serialize_request(&key)
        .expect("csr")
        .pem()
        .expect("pem");
    let shown = sign(&greedy).expect_err("asks for CA").to_string();
    assert!(shown.contains("asks for basicConstraints"), "{shown}");

    assert!(sign("not a request").is_err());

    // The gateway's own CA (pathLen 0) signs leaves, not CAs.
    let leaf_only = CertificateAuthority::create(&tmp.path().join("leafonly")).expect("CA");
    let shown = sign_intermediate(&leaf_only, &csr, &pem, Duration::days(30), now)
        .expect_err("pathLen 0")
        .to_string();
    assert!(shown.contains("pathLen is 0"), "{shown}");

    // Never past the root.
    let long = sign_intermediate(&root, &csr, &pem, Duration::days(365 * 50), now).expect("signed");
    assert!(long.clamped);
    assert_eq!(long.not_after, root.not_after());
    // So far that the date cannot be written (`ca sign --days 4000000`).
    let past_9999 =
        sign_intermediate(&root, &csr, &pem, Duration::days(4_000_000), now).expect("signed");
    assert!(past_9999.clamped);
    assert_eq!(past_9999.not_after, root.not_after());
}

#[test]
fn request_keeps_an_existing_key() {
    let tmp = tempfile::tempdir().expect("temp");
    let dir = tmp.path().join("w");
    request(&dir, "w").expect("first");
    let key = std::fs::read(dir.join("ca.key")).expect("key");
    request(&dir, "w").expect("again");
    assert_eq!(std::fs::read(dir.join("ca.key")).expect("key"), key);
}

#[test]
fn the_leaf_key_is_renewed_when_its_lifetime_is_over() {
    let tmp = tempfile::tempdir().expect("temp");
    let ca = Arc::new(CertificateAuthority::create(tmp.path()).expect("CA"));
    let t0 = OffsetDateTime::now_utc();
    let config = MintConfig {
        key_lifetime: Duration::minutes(10),
        ..MintConfig::default()
    };
    let minter = LeafMinter::new_at(ca, config, t0).expect("minter");
    let api = name("api.example.test");
    let first = minter.leaf_at(&api, t0).expect("leaf");
    let later = minter
        .leaf_at(&api, t0 + Duration::minutes(9))
        .expect("leaf");
    assert!(Arc::ptr_eq(&first, &later), "cached within the lifetime");
    let renewed = minter
        .leaf_at(&api, t0 + Duration::minutes(10))
        .expect("leaf");
    assert_ne!(
        spki(&first.cert[0]),
        spki(&renewed.cert[0]),
        "a new key after the lifetime, and the cached leaf not served"
    );
    let other = minter
        .leaf_at(&name("b.example.test"), t0 + Duration::minutes(11))
        .expect("leaf");
    assert_eq!(spki(&other.cert[0]), spki(&renewed.cert[0]));
    assert_eq!(minter.generations(), 2);
    assert_eq!(minter.minted(), 3);
}

#[test]
fn a_replaced_ca_mints_the_next_leaves_and_drops_the_old_ones() {
    let tmp = tempfile::tempdir().expect("temp");
    let a = Arc::new(CertificateAuthority::create(&tmp.path().join("a")).expect("A"));
    let b = Arc::new(CertificateAuthority::create(&tmp.path().join("b")).expect("B"));
    let minter = LeafMinter::new(a.clone(), MintConfig::default()).expect("minter");
    let api = name("api.example.test");
    let under_a = minter.leaf(&api).expect("leaf");
    assert_eq!(&under_a.cert[1], a.cert_der());
    minter.replace_ca(b.clone()).expect("replace");
    let under_b = minter.leaf(&api).expect("leaf");
    assert_eq!(&under_b.cert[1], b.cert_der(), "not the cached leaf of A");
    assert_eq!(minter.ca().fingerprint(), b.fingerprint());
    assert_eq!(
        &under_a.cert[1],
        a.cert_der(),
        "a leaf handed out is untouched"
    );
}

/// A worker intermediate in `dir` signed now for one day, loaded; and now.
fn a_day_left(dir: &Path) -> (Arc<CertificateAuthority>, OffsetDateTime) {
    let root = CertificateAuthority::create_root(&dir.join("root")).expect("root");
    let worker = dir.join("worker");
    let csr = request(&worker, "worker-1").expect("request");
    let pem = std::fs::read_to_string(&csr).expect("csr");
    let now = OffsetDateTime::now_utc();
    let signed = sign_intermediate(&root, &csr, &pem, Duration::days(1), now).expect("signed");
    let paths = CaPaths::in_dir(&worker);
    std::fs::write(&paths.cert, &signed.chain_pem).expect("write chain");
    (
        Arc::new(CertificateAuthority::load(&paths).expect("loads")),
        now,
    )
}

/// A leaf is never valid past its CA: under an intermediate with a day
/// left, a leaf of the default seven days ends with the intermediate.
#[test]
fn a_leaf_ends_no_later_than_its_ca() {
    let tmp = tempfile::tempdir().expect("temp");
    let (ca, _) = a_day_left(tmp.path());
    let minter = LeafMinter::new(ca.clone(), MintConfig::default()).expect("minter");
    let name = LeafName::Dns(Hostname::parse("api.example.test").expect("name"));
    let leaf = minter.leaf(&name).expect("leaf");
    let (_, cert) = x509_parser::parse_x509_certificate(leaf.cert[0].as_ref()).expect("x509");
    let leaf_end = cert.validity().not_after.timestamp();
    assert_eq!(leaf_end, ca.not_after().unix_timestamp());
}

/// A wall clock stepped back past a cached leaf's start (NTP after a fast
/// clock) mints it again, valid at the new time, instead of serving one
/// that is not valid yet; stepped forward past its end, too.
#[test]
fn a_clock_step_mints_the_leaf_again() {
    let tmp = tempfile::tempdir().expect("temp");
    let ca = Arc::new(CertificateAuthority::create(&tmp.path().join("ca")).expect("CA"));
    let minter = LeafMinter::new(ca, MintConfig::default()).expect("minter");
    let name = LeafName::Dns(Hostname::parse("api.example.test").expect("name"));
    let now = OffsetDateTime::now_utc();
    let starts = |leaf: &rustls::sign::CertifiedKey| {
        let (_, cert) = x509_parser::parse_x509_certificate(leaf.cert[0].as_ref()).expect("x509");
        (
            cert.validity().not_before.timestamp(),
            cert.validity().not_after.timestamp(),
        )
    };
    let first = minter.leaf_at(&name, now).expect("leaf");
    assert_eq!(minter.minted(), 1);
    assert!(Arc::ptr_eq(
        &first,
        &minter.leaf_at(&name, now).expect("cached")
    ));
    let back = now - Duration::days(2);
    let again = minter.leaf_at(&name, back).expect("leaf");
    assert_eq!(
        minter.minted(),
        2,
        "minted again, not served from the cache"
    );
    assert!(starts(&again).0 <= back.unix_timestamp());
    let ahead = now + Duration::days(8);
    let later = minter.leaf_at(&name, ahead).expect("leaf");
    assert_eq!(minter.minted(), 3);
    assert!(starts(&later).1 > ahead.unix_timestamp());
}

/// Under a CA that expired while in service, a leaf (which ends with it)
/// is minted once and served from the cache, not minted at every
/// handshake: no leaf minted then would be valid either.
#[test]
fn a_leaf_under_an_expired_ca_is_not_minted_at_every_handshake() {
    let tmp = tempfile::tempdir().expect("temp");
    let (ca, now) = a_day_left(tmp.path());
    let minter = LeafMinter::new(ca, MintConfig::default()).expect("minter");
    let name = LeafName::Dns(Hostname::parse("api.example.test").expect("name"));
    let later = now + Duration::hours(30);
    minter.leaf_at(&name, later).expect("leaf");
    let minted = minter.minted();
    for _ in 0..3 {
        minter.leaf_at(&name, later).expect("leaf");
    }
    assert_eq!(minter.minted(), minted, "served from the cache");
}
