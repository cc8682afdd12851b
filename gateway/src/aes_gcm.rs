//! Which library seals and opens TLS 1.3 AES-GCM records (`tls.aes_gcm`).
//!
//! The rest of TLS (key exchange, signatures, HKDF, tickets) is aws-lc-rs;
//! AES-GCM, which every byte of an intercepted flow goes through twice (the
//! client's side opened, the origin's sealed, and back), is the one part
//! whose fastest library depends on the CPU. aws-lc-rs has an AVX-512 path
//! (VAES, VPCLMULQDQ, AVX512F/DQ/BW/VL) and, below it, the older AES-NI and
//! AVX one; ring 0.17 has a 256-bit VAES and AVX2 path. On a CPU with
//! AVX-512, aws-lc-rs sealed a 16 KiB record in 0.65 of ring's time; on one
//! with VAES and AVX2 but no AVX-512, ring took 0.55 of aws-lc-rs's
//! (benches/RESULTS.md; `cargo bench -p egress-benches --bench aead`).
//! `auto` takes aws-lc-rs where its AVX-512 path runs, ring on the other
//! x86-64 CPUs, and aws-lc-rs on CPUs of other kinds (not measured here).
//!
//! The record layer is rustls' own ring provider's (`crypto/ring/tls13.rs`),
//! over the same ring calls: only where the AEAD comes from changes.

use std::sync::{Arc, OnceLock};

use ring::aead;
use rustls::crypto::cipher::{
    make_tls13_aad, AeadKey, InboundOpaqueMessage, InboundPlainMessage, Iv, MessageDecrypter,
    MessageEncrypter, Nonce, OutboundOpaqueMessage, OutboundPlainMessage, PrefixedPayload,
    Tls13AeadAlgorithm, UnsupportedOperationError,
};
use rustls::crypto::{aws_lc_rs, CryptoProvider};
use rustls::{
    CipherSuiteCommon, ConnectionTrafficSecrets, ContentType, ProtocolVersion,
    SupportedCipherSuite, Tls13CipherSuite,
};
use serde::{Deserialize, Serialize};

/// `tls.aes_gcm`: which library seals and opens TLS 1.3 AES-GCM records.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum AesGcm {
    /// aws-lc-rs where its AVX-512 AES-GCM runs, ring on other x86-64
    /// CPUs, aws-lc-rs on CPUs of other kinds.
    #[default]
    Auto,
    AwsLcRs,
    Ring,
}

impl AesGcm {
    /// `Auto` decided for this CPU.
    pub fn resolved(self) -> Self {
        match self {
            Self::Auto if aws_lc_has_avx512_gcm() => Self::AwsLcRs,
            Self::Auto => Self::Ring,
            chosen => chosen,
        }
    }
}

/// Whether aws-lc's AVX-512 AES-GCM runs here: the condition of its
/// `crypto_gcm_avx512_enabled`.
fn aws_lc_has_avx512_gcm() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("vaes")
            && std::arch::is_x86_feature_detected!("vpclmulqdq")
            && std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512dq")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vl")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        true
    }
}

/// The gateway's TLS provider: aws-lc-rs's, with its TLS 1.3 AES-GCM suites
/// sealed by ring when `choice` comes to that. Their order, key exchange,
/// hashes and HKDF stay aws-lc-rs's.
pub fn provider(choice: AesGcm) -> Arc<CryptoProvider> {
    let mut provider = aws_lc_rs::default_provider();
    if choice.resolved() == AesGcm::Ring {
        for suite in &mut provider.cipher_suites {
            if let Some(replaced) = with_ring(*suite) {
                *suite = replaced;
            }
        }
    }
    Arc::new(provider)
}

/// `suite` with ring's AEAD in place of its own, for the TLS 1.3 AES-GCM
/// suites; `None` for the others.
fn with_ring(suite: SupportedCipherSuite) -> Option<SupportedCipherSuite> {
    let SupportedCipherSuite::Tls13(tls13) = suite else {
        return None;
    };
    ring_suites()
        .iter()
        .find(|s| s.common.suite == tls13.common.suite)
        .map(SupportedCipherSuite::Tls13)
}

/// aws-lc-rs's TLS 1.3 AES-GCM suites with ring's AEAD, made once.
fn ring_suites() -> &'static [Tls13CipherSuite] {
    static AES_128: RingAesGcm = RingAesGcm(&aead::AES_128_GCM);
    static AES_256: RingAesGcm = RingAesGcm(&aead::AES_256_GCM);
    static SUITES: OnceLock<Vec<Tls13CipherSuite>> = OnceLock::new();
    SUITES.get_or_init(|| {
        let suites = [
            (aws_lc_rs::cipher_suite::TLS13_AES_128_GCM_SHA256, &AES_128),
            (aws_lc_rs::cipher_suite::TLS13_AES_256_GCM_SHA384, &AES_256),
        ];
        suites
            .into_iter()
            .filter_map(|(suite, aead_alg)| {
                let base = suite.tls13()?;
                Some(Tls13CipherSuite {
                    common: CipherSuiteCommon {
                        suite: base.common.suite,
                        hash_provider: base.common.hash_provider,
                        confidentiality_limit: base.common.confidentiality_limit,
                    },
                    hkdf_provider: base.hkdf_provider,
                    aead_alg,
                    quic: None,
                })
            })
            .collect()
    })
}

/// TLS 1.3 AES-GCM by ring.
struct RingAesGcm(&'static aead::Algorithm);

impl RingAesGcm {
    fn key(&self, key: &AeadKey) -> aead::LessSafeKey {
        // rustls hands over `key_len()` bytes, the one length ring refuses none of.
        let unbound = aead::UnboundKey::new(self.0, key.as_ref());
        #[allow(clippy::unwrap_used)]
        aead::LessSafeKey::new(unbound.unwrap())
    }
}

impl Tls13AeadAlgorithm for RingAesGcm {
    fn encrypter(&self, key: AeadKey, iv: Iv) -> Box<dyn MessageEncrypter> {
        Box::new(Sealer {
            key: self.key(&key),
            iv,
        })
    }

    fn decrypter(&self, key: AeadKey, iv: Iv) -> Box<dyn MessageDecrypter> {
        Box::new(Opener {
            key: self.key(&key),
            iv,
        })
    }

    fn key_len(&self) -> usize {
        self.0.key_len()
    }

    fn extract_keys(
        &self,
        key: AeadKey,
        iv: Iv,
    ) -> Result<ConnectionTrafficSecrets, UnsupportedOperationError> {
        Ok(match self.0.key_len() {
            16 => ConnectionTrafficSecrets::Aes128Gcm { key, iv },
            _ => ConnectionTrafficSecrets::Aes256Gcm { key, iv },
        })
    }
}

struct Sealer {
    key: aead::LessSafeKey,
    iv: Iv,
}

struct Opener {
    key: aead::LessSafeKey,
    iv: Iv,
}

impl MessageEncrypter for Sealer {
    fn encrypt(
        &mut self,
        msg: OutboundPlainMessage<'_>,
        seq: u64,
    ) -> Result<OutboundOpaqueMessage, rustls::Error> {
        let total_len = self.encrypted_payload_len(msg.payload.len());
        let mut payload = PrefixedPayload::with_capacity(total_len);
        let nonce = aead::Nonce::assume_unique_for_key(Nonce::new(&self.iv, seq).0);
        let aad = aead::Aad::from(make_tls13_aad(total_len));
        payload.extend_from_chunks(&msg.payload);
        payload.extend_from_slice(&msg.typ.to_array());
        self.key
            .seal_in_place_append_tag(nonce, aad, &mut payload)
            .map_err(|_| rustls::Error::EncryptError)?;
        // Every TLS 1.3 record says TLS 1.2 (RFC 8446 §5.1).
        Ok(OutboundOpaqueMessage::new(
            ContentType::ApplicationData,
            ProtocolVersion::TLSv1_2,
            payload,
        ))
    }

    fn encrypted_payload_len(&self, payload_len: usize) -> usize {
        payload_len + 1 + self.key.algorithm().tag_len()
    }
}

impl MessageDecrypter for Opener {
    fn decrypt<'a>(
        &mut self,
        mut msg: InboundOpaqueMessage<'a>,
        seq: u64,
    ) -> Result<InboundPlainMessage<'a>, rustls::Error> {
        let payload = &mut msg.payload;
        if payload.len() < self.key.algorithm().tag_len() {
            return Err(rustls::Error::DecryptError);
        }
        let nonce = aead::Nonce::assume_unique_for_key(Nonce::new(&self.iv, seq).0);
        let aad = aead::Aad::from(make_tls13_aad(payload.len()));
        let plain_len = self
            .key
            .open_in_place(nonce, aad, payload)
            .map_err(|_| rustls::Error::DecryptError)?
            .len();
        payload.truncate(plain_len);
        msg.into_tls13_unpadded_message()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

    /// `provider` with only the TLS 1.3 suite `which`.
    fn only(provider: &CryptoProvider, which: rustls::CipherSuite) -> Arc<CryptoProvider> {
        let mut p = provider.clone();
        p.cipher_suites.retain(|s| s.suite() == which);
        assert_eq!(p.cipher_suites.len(), 1, "{which:?}");
        Arc::new(p)
    }

    /// Moves what one side has to send into the other until neither has
    /// anything to send.
    fn pump(client: &mut rustls::ClientConnection, server: &mut rustls::ServerConnection) {
        for _ in 0..64 {
            let mut moved = false;
            while client.wants_write() {
                let mut buf = Vec::new();
                client.write_tls(&mut buf).expect("client writes");
                let mut rest = &buf[..];
                while !rest.is_empty() {
                    server.read_tls(&mut rest).expect("server reads");
                    server.process_new_packets().expect("server processes");
                }
                moved = true;
            }
            while server.wants_write() {
                let mut buf = Vec::new();
                server.write_tls(&mut buf).expect("server writes");
                let mut rest = &buf[..];
                while !rest.is_empty() {
                    client.read_tls(&mut rest).expect("client reads");
                    client.process_new_packets().expect("client processes");
                }
                moved = true;
            }
            if !moved {
                return;
            }
        }
    }

    /// All of `want.len()` bytes of plaintext `conn` has read.
    fn read_all(conn: &mut dyn std::io::Read, want: &[u8]) {
        let mut got = vec![0u8; want.len()];
        std::io::Read::read_exact(conn, &mut got).expect("plaintext");
        assert!(got == want, "the bytes that came through differ");
    }

    /// A real handshake and 100 KB each way (16 KiB at a time) between a
    /// side sealing with ring and one sealing with aws-lc-rs, either way
    /// round, for both AES-GCM suites: each reads the other's records.
    #[test]
    fn ring_and_aws_lc_sides_read_each_other() {
        let cert = rcgen::generate_simple_self_signed(vec!["a.test".to_owned()]).expect("cert");
        let der = CertificateDer::from(cert.cert.der().to_vec());
        let key = PrivatePkcs8KeyDer::from(cert.signing_key.serialize_der());
        let mut roots = rustls::RootCertStore::empty();
        roots.add(der.clone()).expect("root");
        let roots = Arc::new(roots);
        let data: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        let (ring, aws) = (provider(AesGcm::Ring), provider(AesGcm::AwsLcRs));
        for which in [
            rustls::CipherSuite::TLS13_AES_128_GCM_SHA256,
            rustls::CipherSuite::TLS13_AES_256_GCM_SHA384,
        ] {
            let aead = |p: &CryptoProvider| {
                let suite = p.cipher_suites.iter().find(|s| s.suite() == which);
                suite
                    .and_then(|s| s.tls13())
                    .map(|t| std::ptr::from_ref(t.aead_alg).cast::<()>())
            };
            assert_ne!(aead(&ring), aead(&aws), "ring's record layer in place");
            for (server_side, client_side) in [(&ring, &aws), (&aws, &ring)] {
                let server = rustls::ServerConfig::builder_with_provider(only(server_side, which))
                    .with_safe_default_protocol_versions()
                    .expect("versions")
                    .with_no_client_auth()
                    .with_single_cert(vec![der.clone()], PrivateKeyDer::Pkcs8(key.clone_key()))
                    .expect("server config");
                let client = rustls::ClientConfig::builder_with_provider(only(client_side, which))
                    .with_safe_default_protocol_versions()
                    .expect("versions")
                    .with_root_certificates(roots.clone())
                    .with_no_client_auth();
                let name = rustls::pki_types::ServerName::try_from("a.test").expect("name");
                let mut c = rustls::ClientConnection::new(Arc::new(client), name).expect("client");
                let mut s = rustls::ServerConnection::new(Arc::new(server)).expect("server");
                pump(&mut c, &mut s);
                assert_eq!(c.negotiated_cipher_suite().map(|s| s.suite()), Some(which));
                for chunk in data.chunks(16 * 1024) {
                    std::io::Write::write_all(&mut c.writer(), chunk).expect("client sends");
                    pump(&mut c, &mut s);
                    read_all(&mut s.reader(), chunk);
                    std::io::Write::write_all(&mut s.writer(), chunk).expect("server sends");
                    pump(&mut c, &mut s);
                    read_all(&mut c.reader(), chunk);
                }
            }
        }
    }

    /// `auto` is one of the two, and names the other only by choice.
    #[test]
    fn auto_resolves_to_a_library() {
        assert_ne!(AesGcm::Auto.resolved(), AesGcm::Auto);
        assert_eq!(AesGcm::Ring.resolved(), AesGcm::Ring);
        assert_eq!(AesGcm::AwsLcRs.resolved(), AesGcm::AwsLcRs);
    }
}
