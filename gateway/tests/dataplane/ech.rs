//! ClientHellos with `encrypted_client_hello` to a name a hostname exemption
//! covers: terminated, never spliced, whether the extension is GREASE (a
//! real rustls client offering GREASE ECH, whose requests keep working) or
//! hand-built bytes over a raw socket.

use std::sync::Arc;

use egress_gateway::peek::fixture::{ech_outer, hello_with, records, sni_data};
use rustls::client::{EchGreaseConfig, EchMode};
use rustls::crypto::hpke::{
    EncapsulatedSecret, Hpke, HpkeOpener, HpkePrivateKey, HpkePublicKey, HpkeSealer, HpkeSuite,
};
use rustls::internal::msgs::enums::{HpkeAead, HpkeKdf, HpkeKem};
use rustls::internal::msgs::handshake::HpkeSymmetricCipherSuite;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::harness::*;

const H1: &[&[u8]] = &[b"http/1.1"];

/// Exempts the relay by name; everything is allowed and intercepted otherwise.
const EXEMPT_RELAY: &str = r#"{"default": "allow", "tls_interception": "on",
    "tls_interception_exemptions": [{"wildcard_domain": "*.relay.example.test"}]}"#;

/// Just enough HPKE for GREASE: a GREASE extension only needs an `enc` of
/// the right size (random bytes stand in for a key share); nothing is sealed.
#[derive(Debug)]
struct GreaseOnly;

#[derive(Debug)]
struct NoSeal;

impl HpkeSealer for NoSeal {
    fn seal(&mut self, _: &[u8], _: &[u8]) -> Result<Vec<u8>, rustls::Error> {
        Err(rustls::Error::General("GREASE seals nothing".into()))
    }
}

impl Hpke for GreaseOnly {
    fn seal(
        &self,
        _: &[u8],
        _: &[u8],
        _: &[u8],
        _: &HpkePublicKey,
    ) -> Result<(EncapsulatedSecret, Vec<u8>), rustls::Error> {
        Err(rustls::Error::General("GREASE seals nothing".into()))
    }

    fn setup_sealer(
        &self,
        _: &[u8],
        _: &HpkePublicKey,
    ) -> Result<(EncapsulatedSecret, Box<dyn HpkeSealer + 'static>), rustls::Error> {
        Ok((EncapsulatedSecret(vec![0x5a; 32]), Box::new(NoSeal)))
    }

    fn open(
        &self,
        _: &EncapsulatedSecret,
        _: &[u8],
        _: &[u8],
        _: &[u8],
        _: &HpkePrivateKey,
    ) -> Result<Vec<u8>, rustls::Error> {
        Err(rustls::Error::General("a client opens nothing".into()))
    }

    fn setup_opener(
        &self,
        _: &EncapsulatedSecret,
        _: &[u8],
        _: &HpkePrivateKey,
    ) -> Result<Box<dyn HpkeOpener + 'static>, rustls::Error> {
        Err(rustls::Error::General("a client opens nothing".into()))
    }

    fn generate_key_pair(&self) -> Result<(HpkePublicKey, HpkePrivateKey), rustls::Error> {
        Err(rustls::Error::General("no keys".into()))
    }

    fn suite(&self) -> HpkeSuite {
        HpkeSuite {
            kem: HpkeKem::DHKEM_X25519_HKDF_SHA256,
            sym: HpkeSymmetricCipherSuite {
                kdf_id: HpkeKdf::HKDF_SHA256,
                aead_id: HpkeAead::AES_128_GCM,
            },
        }
    }
}

static GREASE: GreaseOnly = GreaseOnly;

/// A client trusting what `Env::client_tls` trusts (the gateway CA and
/// the origin CA), offering GREASE ECH (so TLS 1.3 only).
fn grease_client(e: &Env) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(e.gateway.ca().cert_der().clone())
        .expect("gateway CA");
    for c in CertificateDer::pem_slice_iter(e.origin_ca.cert_pem.as_bytes()) {
        roots.add(c.expect("pem")).expect("origin CA");
    }
    let grease = EchGreaseConfig::new(&GREASE, HpkePublicKey(vec![0x42; 32]));
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut c = rustls::ClientConfig::builder_with_provider(provider)
        .with_ech(EchMode::Grease(grease))
        .expect("GREASE ECH")
        .with_root_certificates(roots)
        .with_no_client_auth();
    c.alpn_protocols = vec![b"http/1.1".to_vec()];
    Arc::new(c)
}

#[tokio::test(flavor = "current_thread")]
async fn grease_ech_to_an_exempt_name_is_intercepted_and_its_requests_work() {
    let e = env(Options::default()).await;
    e.sandbox("a", SANDBOX_A, policy(EXEMPT_RELAY));
    e.resolve(SANDBOX_A, "a.relay.example.test.").await;

    // Without ECH the exemption splices: the origin's own certificate.
    let (_, minted) = e
        .tls(SANDBOX_A, e.origins.relay, "a.relay.example.test", H1)
        .await
        .expect("handshake");
    assert!(!minted, "no ECH: spliced");

    // With GREASE ECH: the gateway's certificate, and the request works.
    let tcp = e.connect(SANDBOX_A, e.origins.relay).await;
    let name = ServerName::try_from("a.relay.example.test").expect("name");
    let tls = tokio_rustls::TlsConnector::from(grease_client(&e))
        .connect(name, tcp)
        .await
        .expect("the gateway ignores GREASE ECH");
    let leaf = tls.get_ref().1.peer_certificates().expect("certificates")[0].clone();
    let needle = b"egress-gateway interception CA";
    assert!(
        leaf.as_ref().windows(needle.len()).any(|w| w == needle),
        "ECH: intercepted, the leaf is the gateway's"
    );
    let (status, body) = http_get(tls, false, "a.relay.example.test", "/x")
        .await
        .expect("request");
    assert_eq!(
        (status, body.starts_with("origin=relay")),
        (200, true),
        "{body}"
    );

    let lines = e.flow_lines(2).await;
    let ech = lines
        .iter()
        .find(|l| l["verdict"] == json!("intercept"))
        .expect("an intercepted line");
    assert_eq!(ech["reason"], json!("ech"), "{ech}");
    assert!(
        ech["detail"]
            .as_str()
            .unwrap_or_default()
            .contains("exemption not applied: ech"),
        "{ech}"
    );
    assert!(
        lines.iter().any(|l| l["reason"] == json!("exempt")),
        "{lines:?}"
    );
}

/// Hand-built bytes: an outer ECH extension beside an exempt, attributed
/// server name. The flow is judged `intercept`/`ech`, and nothing reaches
/// the origin's TLS stack by splice (the gateway's own TLS answers).
#[tokio::test(flavor = "current_thread")]
async fn a_hand_built_ech_hello_to_an_exempt_name_is_not_spliced() {
    let e = env(Options::default()).await;
    e.sandbox("a", SANDBOX_A, policy(EXEMPT_RELAY));
    e.resolve(SANDBOX_A, "a.relay.example.test.").await;
    let sni = (0x0000u16, sni_data(&[(0, b"a.relay.example.test")]));
    for exts in [
        vec![sni.clone(), (0xfe0d, ech_outer(0x17, 32, 180))],
        vec![sni.clone()],
    ] {
        let mut s = e.connect(SANDBOX_A, e.origins.relay).await;
        s.write_all(&records(&hello_with(&exts), 16_384))
            .await
            .expect("write");
        // Whoever answers ends this TLS 1.2-less, key-share-less hello with
        // an alert; the flow log says who it was.
        let mut buf = [0u8; 64];
        let _ = tokio::time::timeout(std::time::Duration::from_secs(3), s.read(&mut buf)).await;
        drop(s);
    }
    let lines = e.flow_lines(2).await;
    let verdicts: Vec<_> = lines
        .iter()
        .map(|l| (l["verdict"].clone(), l["reason"].clone()))
        .collect();
    assert_eq!(
        verdicts,
        [
            (json!("intercept"), json!("ech")),
            (json!("splice"), json!("exempt")),
        ],
        "{lines:?}"
    );
}
