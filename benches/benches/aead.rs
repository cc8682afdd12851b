//! AES-256-GCM on one TLS record, the work rustls' crypto provider does per
//! record each way: ring against aws-lc-rs, the two libraries the gateway
//! chooses between (`tls.aes_gcm`), at the sizes of a keep-alive response
//! (1 KiB) and of a full record (16 KiB). Both are called as rustls calls
//! them (`LessSafeKey`, sealed in place, the tag apart). Which is faster
//! depends on the CPU's vector units: on one with VAES and AVX-512,
//! aws-lc-rs has a 512-bit path ring lacks; on one with VAES and AVX2 only,
//! ring has a 256-bit VAES path and aws-lc-rs falls back to AES-NI and AVX.
//!
//! `cargo bench -p egress-benches --bench aead`

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};

const KEY: [u8; 32] = [7; 32];

fn nonce(i: u64) -> [u8; 12] {
    let mut n = [0u8; 12];
    n[4..].copy_from_slice(&i.to_be_bytes());
    n
}

fn bench_seal(c: &mut Criterion) {
    let ring_key = ring::aead::LessSafeKey::new(
        ring::aead::UnboundKey::new(&ring::aead::AES_256_GCM, &KEY).expect("ring key"),
    );
    let aws_key = aws_lc_rs::aead::LessSafeKey::new(
        aws_lc_rs::aead::UnboundKey::new(&aws_lc_rs::aead::AES_256_GCM, &KEY).expect("aws key"),
    );
    let mut group = c.benchmark_group("aes256gcm_seal");
    for size in [1024usize, 16 * 1024] {
        group.throughput(Throughput::Bytes(size as u64));
        let mut record = vec![1u8; size];
        let mut i = 0u64;
        group.bench_function(format!("ring/{size}"), |b| {
            b.iter(|| {
                i += 1;
                let n = ring::aead::Nonce::assume_unique_for_key(nonce(i));
                ring_key
                    .seal_in_place_separate_tag(n, ring::aead::Aad::empty(), black_box(&mut record))
                    .expect("sealed")
            })
        });
        group.bench_function(format!("aws-lc-rs/{size}"), |b| {
            b.iter(|| {
                i += 1;
                let n = aws_lc_rs::aead::Nonce::assume_unique_for_key(nonce(i));
                aws_key
                    .seal_in_place_separate_tag(
                        n,
                        aws_lc_rs::aead::Aad::empty(),
                        black_box(&mut record),
                    )
                    .expect("sealed")
            })
        });
    }
    group.finish();
}

/// The two agree: the same key, nonce and plaintext give the same record.
fn same_output() {
    let ring_key = ring::aead::LessSafeKey::new(
        ring::aead::UnboundKey::new(&ring::aead::AES_256_GCM, &KEY).expect("ring key"),
    );
    let aws_key = aws_lc_rs::aead::LessSafeKey::new(
        aws_lc_rs::aead::UnboundKey::new(&aws_lc_rs::aead::AES_256_GCM, &KEY).expect("aws key"),
    );
    let (mut a, mut b) = (vec![3u8; 1500], vec![3u8; 1500]);
    let ta = ring_key
        .seal_in_place_separate_tag(
            ring::aead::Nonce::assume_unique_for_key(nonce(9)),
            ring::aead::Aad::from(b"hdr"),
            &mut a,
        )
        .expect("sealed");
    let tb = aws_key
        .seal_in_place_separate_tag(
            aws_lc_rs::aead::Nonce::assume_unique_for_key(nonce(9)),
            aws_lc_rs::aead::Aad::from(b"hdr"),
            &mut b,
        )
        .expect("sealed");
    assert_eq!(a, b, "ciphertexts differ");
    assert_eq!(ta.as_ref(), tb.as_ref(), "tags differ");
}

fn bench_all(c: &mut Criterion) {
    same_output();
    bench_seal(c);
}

criterion_group!(benches, bench_all);
criterion_main!(benches);
