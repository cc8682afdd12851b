//! Real TLS handshakes on loopback against leaves minted under a throwaway CA.

mod support;
use support::server;

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use egress_certs::{CertificateAuthority, LeafMinter, LeafName, LeafResolver, MintConfig};
use egress_policy::Hostname;
use rustls::client::danger::ServerCertVerifier;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{ClientConfig, RootCertStore};
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

struct Fixture {
    _dir: tempfile::TempDir,
    ca: Arc<CertificateAuthority>,
}

fn fixture() -> Fixture {
    let dir = tempfile::tempdir().expect("temp dir");
    let ca = Arc::new(CertificateAuthority::create(dir.path()).expect("CA"));
    Fixture { _dir: dir, ca }
}

fn minter(ca: &Arc<CertificateAuthority>, capacity: u64) -> Arc<LeafMinter> {
    let config = MintConfig {
        cache_capacity: capacity,
        ..MintConfig::default()
    };
    Arc::new(LeafMinter::new(ca.clone(), config).expect("minter"))
}

/// A client that trusts the test CA and nothing else.
fn client(ca: &CertificateAuthority) -> TlsConnector {
    let mut roots = RootCertStore::empty();
    roots
        .add(ca.cert_der().clone())
        .expect("CA is a valid root");
    let config = ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    TlsConnector::from(Arc::new(config))
}

/// Connects with `name` as the server name; `Ok` once `ok` arrives over verified TLS.
async fn handshake(
    addr: SocketAddr,
    connector: &TlsConnector,
    name: ServerName<'static>,
) -> std::io::Result<()> {
    let tcp = TcpStream::connect(addr).await?;
    let mut tls = connector.connect(name, tcp).await?;
    let mut buf = [0u8; 2];
    tls.read_exact(&mut buf).await?;
    assert_eq!(&buf, b"ok");
    Ok(())
}

fn dns(s: &str) -> ServerName<'static> {
    ServerName::try_from(s.to_owned()).expect("valid server name")
}

fn leaf_der(minter: &LeafMinter, name: &str) -> CertificateDer<'static> {
    let leaf = minter
        .leaf(&LeafName::Dns(Hostname::parse(name).expect("valid")))
        .expect("minted");
    leaf.cert[0].clone()
}

#[tokio::test]
async fn leaf_verifies_for_its_name() {
    let f = fixture();
    let m = minter(&f.ca, 100);
    let addr = server(LeafResolver::new(m.clone(), None)).await;
    let c = client(&f.ca);
    handshake(addr, &c, dns("api.example.test"))
        .await
        .expect("verified handshake");
    handshake(addr, &c, dns("a.b.c.example.test"))
        .await
        .expect("verified handshake");
    assert_eq!(m.minted(), 2);
    handshake(addr, &c, dns("api.example.test"))
        .await
        .expect("cached leaf");
    assert_eq!(m.minted(), 2, "second handshake served from the cache");
}

#[test]
fn leaf_fails_verification_for_another_name_and_another_ca() {
    let f = fixture();
    let m = minter(&f.ca, 100);
    let leaf = leaf_der(&m, "api.example.test");
    let verify = |ca: &CertificateAuthority, name: &str| {
        let mut roots = RootCertStore::empty();
        roots.add(ca.cert_der().clone()).expect("root");
        let verifier = rustls::client::WebPkiServerVerifier::builder(Arc::new(roots))
            .build()
            .expect("verifier");
        verifier.verify_server_cert(&leaf, &[], &dns(name), &[], UnixTime::now())
    };
    assert!(verify(&f.ca, "api.example.test").is_ok());
    let err = verify(&f.ca, "other.example.test").expect_err("wrong name");
    assert!(err.to_string().contains("not valid for name"), "{err}");
    let other = fixture();
    assert!(
        verify(&other.ca, "api.example.test").is_err(),
        "another CA does not vouch for it"
    );
}

#[tokio::test]
async fn ip_san_without_sni() {
    let f = fixture();
    let m = minter(&f.ca, 100);
    let ip: IpAddr = "203.0.113.7".parse().expect("ip");
    let addr = server(LeafResolver::new(m.clone(), Some(ip))).await;
    let c = client(&f.ca);
    // rustls sends no SNI for an IP address, so the server falls back to the destination IP.
    handshake(addr, &c, ServerName::IpAddress(ip.into()))
        .await
        .expect("IP SAN verifies");
    let other: IpAddr = "203.0.113.8".parse().expect("ip");
    assert!(
        handshake(addr, &c, ServerName::IpAddress(other.into()))
            .await
            .is_err(),
        "leaf is for .7 only"
    );

    // Without a fallback there is nothing to mint for: the handshake is refused.
    let addr = server(LeafResolver::new(m, None)).await;
    assert!(handshake(addr, &c, ServerName::IpAddress(ip.into()))
        .await
        .is_err());
}

#[tokio::test]
async fn odd_server_names_are_normalised() {
    let f = fixture();
    let m = minter(&f.ca, 100);
    let addr = server(LeafResolver::new(m.clone(), None)).await;
    let c = client(&f.ca);
    handshake(addr, &c, dns("API.Example.TEST"))
        .await
        .expect("upper case");
    handshake(addr, &c, dns("api.example.test."))
        .await
        .expect("trailing dot");
    assert_eq!(m.minted(), 1, "all spellings share one normalised leaf");
}

#[test]
fn leaf_name_mapping_never_panics_and_falls_back_to_the_ip() {
    let f = fixture();
    let ip: IpAddr = "2001:db8::7".parse().expect("ip");
    let r = LeafResolver::new(minter(&f.ca, 10), Some(ip));
    let long = format!("{}.test", "a.".repeat(130));
    let cases: &[(Option<&str>, LeafName)] = &[
        (
            Some("API.Example.Test."),
            LeafName::Dns(Hostname::parse("api.example.test").expect("valid")),
        ),
        (None, LeafName::Ip(ip)),
        (Some("203.0.113.7"), LeafName::Ip(ip)),
        (Some("*.example.test"), LeafName::Ip(ip)),
        (Some(""), LeafName::Ip(ip)),
        (Some(long.as_str()), LeafName::Ip(ip)),
        (Some("bad_name.test"), LeafName::Ip(ip)),
        (Some("é.test"), LeafName::Ip(ip)),
    ];
    for (sni, want) in cases {
        assert_eq!(r.leaf_name(*sni).as_ref(), Some(want), "{sni:?}");
    }
    let no_fallback = LeafResolver::new(minter(&f.ca, 10), None);
    assert_eq!(no_fallback.leaf_name(Some("203.0.113.7")), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_concurrent_handshakes_for_a_new_name_mint_once() {
    let f = fixture();
    let m = minter(&f.ca, 100);
    let addr = server(LeafResolver::new(m.clone(), None)).await;
    let c = client(&f.ca);
    let tasks: Vec<_> = (0..1000)
        .map(|_| {
            let c = c.clone();
            tokio::spawn(async move { handshake(addr, &c, dns("burst.example.test")).await })
        })
        .collect();
    for t in tasks {
        t.await.expect("task").expect("handshake");
    }
    assert_eq!(m.minted(), 1);
}

#[test]
fn concurrent_callers_for_one_name_share_one_mint() {
    let f = fixture();
    let m = minter(&f.ca, 100);
    let name = LeafName::Dns(Hostname::parse("threads.example.test").expect("valid"));
    let barrier = Arc::new(std::sync::Barrier::new(16));
    let leaves: Vec<_> = (0..16)
        .map(|_| {
            let (m, name, barrier) = (m.clone(), name.clone(), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                m.leaf(&name).expect("minted")
            })
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|t| t.join().expect("thread"))
        .collect();
    assert_eq!(m.minted(), 1);
    assert!(
        leaves.windows(2).all(|w| Arc::ptr_eq(&w[0], &w[1])),
        "one shared leaf"
    );
}

#[test]
fn cache_stays_within_its_bound_under_100k_names() {
    let f = fixture();
    let m = minter(&f.ca, 1_000);
    for i in 0..100_000u32 {
        let name =
            LeafName::Dns(Hostname::parse(&format!("n{i}.flood.example.test")).expect("valid"));
        m.leaf(&name).expect("minted");
    }
    m.sync_cache();
    assert_eq!(m.minted(), 100_000);
    assert!(m.cached() <= 1_000, "cached {}", m.cached());
}

#[test]
fn leaves_are_short_lived_backdated_with_random_serials_and_carry_the_chain() {
    let f = fixture();
    let m = minter(&f.ca, 100);
    let leaf = m
        .leaf(&LeafName::Dns(
            Hostname::parse("a.example.test").expect("valid"),
        ))
        .expect("minted");
    assert_eq!(leaf.cert.len(), 2, "leaf and CA");
    assert_eq!(&leaf.cert[1], f.ca.cert_der());
    let other = leaf_der(&m, "b.example.test");
    let parse = |der: &CertificateDer<'_>| {
        let (_, c) = x509_parser::parse_x509_certificate(der.as_ref()).expect("parses");
        (
            c.validity().not_before.timestamp(),
            c.validity().not_after.timestamp(),
            c.raw_serial().to_vec(),
        )
    };
    let (nb, na, serial_a) = parse(&leaf.cert[0]);
    let (_, _, serial_b) = parse(&other);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs() as i64;
    assert!(
        (now - 3600 - 60..=now - 3600 + 60).contains(&nb),
        "backdated an hour: {nb} vs {now}"
    );
    assert!(
        (now + 7 * 86400 - 60..=now + 7 * 86400 + 60).contains(&na),
        "valid 7 days: {na} vs {now}"
    );
    assert_ne!(
        serial_a, serial_b,
        "serials differ although the key is shared"
    );
    assert!(serial_a.len() >= 16);
}
