//! The first flights of real TLS clients, captured on loopback, replayed
//! through the classifier (linkerd replays
//! `testdata/example-com-client-hello.bin` the same way).
//!
//! Each file holds what one client sent to `127.0.0.1` for
//! `captured.example.test`, cut at the end of the record that completes its
//! ClientHello: nothing a server said, no second flight. `openssl-frag` is
//! OpenSSL with `-max_send_frag 512` and a long ALPN list, so its hello spans
//! three records. The capture listener and the client commands are in
//! `fuzz/capture/capture.sh` (run in a throwaway network namespace with only
//! loopback); the same files seed the `peek_segments` fuzz target.

use super::{classify_bytes, peek, Classified, ClientHello};
use egress_policy::Hostname;

/// (client, bytes), one per captured client.
const CAPTURED: &[(&str, &[u8])] = &[
    ("curl", include_bytes!("captured/curl.bin")),
    ("curl-tls12", include_bytes!("captured/curl-tls12.bin")),
    ("openssl", include_bytes!("captured/openssl.bin")),
    (
        "openssl-tls12",
        include_bytes!("captured/openssl-tls12.bin"),
    ),
    ("openssl-frag", include_bytes!("captured/openssl-frag.bin")),
    ("python", include_bytes!("captured/python.bin")),
    ("node", include_bytes!("captured/node.bin")),
    ("java", include_bytes!("captured/java.bin")),
    ("go", include_bytes!("captured/go.bin")),
    ("chromium", include_bytes!("captured/chromium.bin")),
];

/// Chromium sends GREASE ECH by default (an outer `encrypted_client_hello`
/// with random bytes); the others send no ECH.
fn expected(client: &str) -> Classified {
    Classified::Tls(ClientHello {
        sni: Some(Hostname::parse("captured.example.test").expect("hostname")),
        early_data: false,
        ech: client == "chromium",
    })
}

#[test]
fn every_captured_hello_names_the_server() {
    for (client, bytes) in CAPTURED {
        assert_eq!(
            classify_bytes(bytes),
            Ok(Some(expected(client))),
            "{client}: the whole first flight"
        );
    }
}

#[test]
fn every_prefix_of_a_captured_hello_waits_for_more() {
    for (client, bytes) in CAPTURED {
        for end in 0..bytes.len() {
            assert_eq!(
                classify_bytes(&bytes[..end]),
                Ok(None),
                "{client}: prefix of {end} of {} bytes",
                bytes.len()
            );
        }
    }
}

#[test]
fn the_fragmented_capture_spans_several_records() {
    let bytes = CAPTURED
        .iter()
        .find(|(c, _)| *c == "openssl-frag")
        .map(|(_, b)| *b)
        .expect("captured");
    let mut records = 0;
    let mut off = 0;
    while let Some(header) = bytes.get(off..off + 5) {
        off += 5 + usize::from(u16::from_be_bytes([header[3], header[4]]));
        records += 1;
    }
    assert_eq!(off, bytes.len(), "whole records only");
    assert!(records >= 3, "{records} records");
}

#[tokio::test]
async fn captured_hellos_byte_by_byte_through_peek() {
    for (client, bytes) in CAPTURED {
        let (mut client_end, mut server_end) = tokio::io::duplex(1);
        let data = bytes.to_vec();
        let writer = tokio::spawn(async move {
            use tokio::io::AsyncWriteExt;
            for b in data {
                if client_end.write_all(&[b]).await.is_err() {
                    break;
                }
            }
            // Keep the connection open: the hello alone must classify it.
            client_end
        });
        let (c, read) = peek(
            &mut server_end,
            16 * 1024,
            std::time::Duration::from_secs(5),
        )
        .await
        .expect("classified");
        assert_eq!(c, expected(client), "{client}");
        assert_eq!(read, *bytes, "{client}: everything read is handed back");
        drop(writer.await);
    }
}
