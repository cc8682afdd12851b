use super::*;

/// A HelloRetryRequest record: a ServerHello with the retry random, its
/// message cut over `records` handshake records.
fn retry_request(records: usize) -> Vec<u8> {
    let mut body = vec![0x03, 0x03];
    body.extend_from_slice(&HRR_RANDOM);
    body.extend_from_slice(&[0, 0x13, 0x01, 0]);
    // supported_versions: TLS 1.3; key_share: secp256r1.
    body.extend_from_slice(&[0, 12, 0, 0x2b, 0, 2, 3, 4, 0, 0x33, 0, 2, 0, 0x17]);
    let mut message = vec![SERVER_HELLO, 0, 0, body.len() as u8];
    message.extend_from_slice(&body);
    let mut out = Vec::new();
    for part in message.chunks(message.len().div_ceil(records)) {
        out.extend_from_slice(&[HANDSHAKE, 3, 3, 0, part.len() as u8]);
        out.extend_from_slice(part);
    }
    out
}

#[test]
fn the_first_message_tells_a_retry_request_from_a_server_hello() {
    for records in [1, 2, 3] {
        let hrr = retry_request(records);
        for cut in 0..hrr.len() {
            match first_message(&hrr[..cut]) {
                First::NeedMore
                | First::Hello {
                    retry: true,
                    whole: None,
                } => {}
                other => panic!("cut {cut} of {records}: {other:?}"),
            }
        }
        let whole = Some(hrr.len());
        assert_eq!(first_message(&hrr), First::Hello { retry: true, whole });
        // What follows (a change_cipher_spec) is not part of it.
        let mut more = hrr.clone();
        more.extend_from_slice(&[0x14, 3, 3, 0, 1, 1]);
        assert_eq!(first_message(&more), First::Hello { retry: true, whole });
    }
    let mut hello = retry_request(1);
    hello[5 + 4 + 2] ^= 1; // another random: a ServerHello
    assert!(matches!(
        first_message(&hello),
        First::Hello { retry: false, .. }
    ));
    assert_eq!(
        first_message(&[0x15, 3, 3, 0, 2, 2, 40]),
        First::Other,
        "an alert"
    );
    assert_eq!(first_message(b"HTTP/1.1 400 Bad Request\r\n"), First::Other);
    let mut cert = retry_request(1);
    cert[5] = 11; // a handshake message that is no ServerHello
    assert_eq!(first_message(&cert), First::Other);
    // Records no TLS peer sends: refused, not read from the start at every
    // read for as long as the origin sends them.
    assert_eq!(
        first_message(&[HANDSHAKE, 3, 3, 0, 0].repeat(5_000)),
        First::Malformed("an empty handshake record from the origin")
    );
    // A 104-byte retry request in 52 records of 2 bytes, then in 104 of 1.
    let mut message = vec![SERVER_HELLO, 0, 0, 100, 3, 3];
    message.extend_from_slice(&HRR_RANDOM);
    message.resize(104, 0);
    let cut = |size: usize| -> Vec<u8> {
        message
            .chunks(size)
            .flat_map(|part| [&[HANDSHAKE, 3, 3, 0, part.len() as u8][..], part].concat())
            .collect()
    };
    let whole = Some(cut(2).len());
    assert_eq!(first_message(&cut(2)), First::Hello { retry: true, whole });
    assert_eq!(
        first_message(&cut(1)),
        First::Malformed("the origin's first handshake message in more than 64 records")
    );
}

/// A client gone before the server's first message reaches it is told
/// apart from a second ClientHello refused: no retry was involved (it was
/// counted as one, `hello_retry`, which operators watch for evasion).
#[tokio::test]
async fn a_client_gone_before_the_servers_hello_is_no_retry_failure() {
    use tokio::io::AsyncWriteExt;
    use tokio::net::{TcpListener, TcpStream};
    let pair = || async {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let near = TcpStream::connect(l.local_addr().expect("addr"))
            .await
            .expect("connect");
        let (far, _) = l.accept().await.expect("accept");
        (near, far)
    };
    let (mut client, client_peer) = pair().await;
    let (mut origin, mut origin_peer) = pair().await;
    crate::io::reset(&client_peer);
    drop(client_peer);
    let mut hello = retry_request(1);
    hello[5 + 4 + 2] ^= 1; // another random: a ServerHello
    origin_peer.write_all(&hello).await.expect("hello");
    tokio::time::sleep(Duration::from_millis(100)).await;
    let judged = Judged {
        sni: None,
        ech: false,
    };
    let bounds = (16 * 1024, Duration::from_secs(2));
    let watched = watch(
        (&mut client, &mut origin),
        judged,
        Vec::new(),
        bounds,
        &|_| true,
    )
    .await;
    let e = watched.expect_err("the client is gone");
    assert!(matches!(e, RetryError::ClientGone(_)), "{e:?}");
    assert!(!e.to_string().contains("HelloRetryRequest"), "{e}");
}
