use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::io::ReadBuf;

use super::fixture::{ech_outer, handshake, hello, hello_with, records, sni_data};
use super::*;

/// Yields at most `step` bytes per read: a slow, segmented sender.
struct Trickle {
    data: Vec<u8>,
    pos: usize,
    step: usize,
}

impl AsyncRead for Trickle {
    fn poll_read(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let n = self
            .step
            .min(self.data.len() - self.pos)
            .min(buf.remaining());
        let start = self.pos;
        buf.put_slice(&self.data[start..start + n]);
        self.pos += n;
        Poll::Ready(Ok(()))
    }
}

async fn run(data: Vec<u8>, step: usize) -> Result<(Classified, Vec<u8>), PeekError> {
    let mut t = Trickle { data, pos: 0, step };
    peek(&mut t, 16 * 1024, Duration::from_secs(5)).await
}

fn tls(sni: Option<&str>) -> Classified {
    Classified::Tls(ClientHello {
        sni: sni.map(name),
        ..ClientHello::default()
    })
}

fn name(s: &str) -> Hostname {
    Hostname::parse(s).expect("hostname")
}

#[tokio::test]
async fn client_hello_in_one_record() {
    let bytes = records(
        &hello(Some("api.example.test"), &["h2", "http/1.1"], 0, false),
        16_384,
    );
    let (c, read) = run(bytes.clone(), 4096).await.expect("classified");
    assert_eq!(
        c,
        Classified::Tls(ClientHello {
            sni: Some(name("api.example.test")),
            early_data: false,
            ech: false,
        })
    );
    assert_eq!(read, bytes, "everything read is handed back for replay");
}

#[tokio::test]
async fn post_quantum_sized_hello_split_over_records_and_sent_byte_by_byte() {
    let hs = hello(Some("pq.example.test"), &["h2"], 1_800, true);
    assert!(hs.len() > 1_900);
    for (fragment, step) in [(100, 1), (16_384, 1), (40, 13), (1_000, 1_460)] {
        let bytes = records(&hs, fragment);
        let (c, read) = run(bytes.clone(), step).await.expect("classified");
        let Classified::Tls(ch) = c else {
            panic!("not TLS")
        };
        assert_eq!(
            ch.sni.as_ref().map(Hostname::as_str),
            Some("pq.example.test"),
            "fragment {fragment} step {step}"
        );
        assert!(ch.early_data);
        assert_eq!(read, bytes);
    }
}

/// A ClientHello is read from at most 64 records: in more it is refused,
/// not reassembled again from every record so far at each read.
#[tokio::test]
async fn a_hello_in_more_than_64_records_is_refused() {
    let hs = hello(Some("many.example.test"), &["h2"], 0, false);
    let count = |f: usize| hs.len().div_ceil(f);
    let f = (1..)
        .find(|&f| count(f) <= MAX_HELLO_RECORDS)
        .expect("a size");
    assert!(f > 1 && count(f - 1) > MAX_HELLO_RECORDS);
    let (c, _) = run(records(&hs, f), 1).await.expect("in 64 records");
    assert_eq!(c, tls(Some("many.example.test")));
    assert_eq!(
        run(records(&hs, f - 1), 1).await.map(|x| x.0),
        Err(PeekError::Malformed(
            "a ClientHello in more than 64 records"
        ))
    );
    // Before a second ClientHello, as many records of other types.
    let ccs = [0x14, 3, 3, 0, 1, 1];
    let second = records(&hs, 16_384);
    for (n, read) in [(MAX_HELLO_RECORDS, true), (MAX_HELLO_RECORDS + 1, false)] {
        let bytes = [ccs.repeat(n), second.clone()].concat();
        let got = second_client_hello(&bytes);
        assert_eq!(got.is_ok(), read, "{n}: {got:?}");
    }
}

/// What is read is classified again only when a record's header or a
/// record is whole: a hello sent a byte at a time is read twice a record,
/// not once a byte.
#[test]
fn records_say_when_a_header_or_a_record_is_whole() {
    let hs = hello(Some("slow.example.test"), &["h2"], 1_800, false);
    let bytes = records(&hs, 100);
    let n = hs.len().div_ceil(100);
    let mut r = Records::default();
    let news = (1..=bytes.len())
        .filter(|&end| r.advanced(&bytes[..end]))
        .count();
    assert_eq!(news, 2 * n);
}

/// Past its first bytes, a stream that is not TLS is read again only at a
/// line end after some text: a run of line ends (which nginx skips before
/// a request line) sent a byte at a time is not read again at every byte.
#[test]
fn lines_say_when_a_line_ends_after_text() {
    let mut l = Lines::default();
    let blank = (0..16_384).filter(|&i| l.advanced(i, b"\n")).count();
    assert_eq!(blank, LINE_READ_AHEAD);
    assert!(l.advanced(16_384, b"G"), "the first text");
    assert!(!l.advanced(16_385, b"E"));
    assert!(l.advanced(16_386, b"\n"), "a line end after text");
}

#[tokio::test]
async fn hello_from_rustls_parses() {
    let mut roots = rustls::RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    let mut config = rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec()];
    let server = rustls::pki_types::ServerName::try_from("real.example.test").expect("name");
    let mut conn = rustls::ClientConnection::new(Arc::new(config), server).expect("client");
    let mut bytes = Vec::new();
    conn.write_tls(&mut bytes).expect("hello");
    let (c, _) = run(bytes, 1).await.expect("classified");
    let Classified::Tls(ch) = c else {
        panic!("not TLS")
    };
    assert_eq!(ch.sni, Some(name("real.example.test")));
}

/// `encrypted_client_hello` is seen wherever it sits, in every form: the
/// outer variant (real or GREASE), the inner one a client must not send in
/// the clear, an empty one. Without it the hello is not ECH.
#[tokio::test]
async fn an_encrypted_client_hello_extension_is_seen_in_every_form() {
    let sni = || (0x0000u16, sni_data(&[(0, b"public.example.test")]));
    let alpn = (0x0010u16, vec![0, 3, 2, b'h', b'2']);
    let forms: [(&str, Vec<u8>); 3] = [
        ("outer", ech_outer(0x2a, 32, 200)),
        ("inner", vec![1]),
        ("empty", vec![]),
    ];
    for (what, data) in forms {
        for exts in [
            vec![sni(), (0xfe0d, data.clone()), alpn.clone()],
            vec![(0xfe0d, data.clone()), sni()],
            vec![sni(), alpn.clone(), (0xfe0d, data.clone())],
        ] {
            let hs = hello_with(&exts);
            for (fragment, step) in [(16_384, 4_096), (40, 1)] {
                let (c, _) = run(records(&hs, fragment), step).await.expect(what);
                assert_eq!(
                    c,
                    Classified::Tls(ClientHello {
                        sni: Some(name("public.example.test")),
                        early_data: false,
                        ech: true,
                    }),
                    "{what}, fragment {fragment}"
                );
            }
        }
    }
    let (c, _) = run(records(&hello_with(&[sni(), alpn]), 16_384), 4_096)
        .await
        .expect("classified");
    assert_eq!(c, tls(Some("public.example.test")), "no extension, no ECH");
    // The drafts' code points and ESNI's hide a name as well.
    for code in [0xfe08u16, 0xfe0a, 0xfe0c, 0xffce] {
        let hs = hello_with(&[sni(), (code, ech_outer(1, 32, 100))]);
        let (c, _) = run(records(&hs, 16_384), 4_096).await.expect("classified");
        assert!(
            matches!(c, Classified::Tls(ClientHello { ech: true, .. })),
            "{code:#x}: {c:?}"
        );
    }
    // Twice is malformed like any other repeated extension.
    let twice = hello_with(&[(0xfe0d, ech_outer(1, 32, 100)), sni(), (0xfe0d, vec![1])]);
    assert_eq!(
        run(records(&twice, 16_384), 4_096).await,
        Err(PeekError::Malformed("an extension type appears twice"))
    );
}

#[test]
fn every_prefix_of_an_ech_hello_waits_for_more() {
    let hs = hello_with(&[
        (0x0000, sni_data(&[(0, b"public.example.test")])),
        (0xfe0d, ech_outer(7, 32, 150)),
    ]);
    let bytes = records(&hs, 60);
    for end in 0..bytes.len() {
        assert!(
            matches!(classify(&bytes[..end]), Ok(Step::NeedMore)),
            "prefix {end}"
        );
    }
    assert!(matches!(
        classify(&bytes),
        Ok(Step::Done(Classified::Tls(ClientHello { ech: true, .. })))
    ));
}

#[tokio::test]
async fn every_prefix_of_a_hello_waits_for_more() {
    let bytes = records(&hello(Some("a.test"), &[], 0, false), 50);
    for end in 0..bytes.len() {
        assert!(
            matches!(classify(&bytes[..end]), Ok(Step::NeedMore)),
            "prefix {end}"
        );
    }
    assert!(matches!(
        classify(&bytes),
        Ok(Step::Done(Classified::Tls(_)))
    ));
    assert_eq!(
        run(bytes[..bytes.len() - 1].to_vec(), 64).await,
        Err(PeekError::Closed)
    );
}

#[tokio::test]
async fn hello_without_sni_and_malformed_hellos() {
    assert_eq!(
        run(records(&hello(None, &[], 0, false), 16_384), 100)
            .await
            .map(|x| x.0),
        Ok(tls(None))
    );
    let mut not_hello = hello(Some("a.test"), &[], 0, false);
    not_hello[0] = 2;
    assert!(matches!(
        run(records(&not_hello, 16_384), 100).await,
        Err(PeekError::Malformed(_))
    ));
    let mut bad_len = records(&hello(Some("a.test"), &[], 0, false), 16_384);
    bad_len[3] = 0xff;
    bad_len[4] = 0xff;
    assert!(matches!(
        run(bad_len, 100).await,
        Err(PeekError::Malformed(_))
    ));
    let mut alert_between = records(&hello(Some("a.test"), &[], 0, false), 40);
    alert_between[45] = 0x15;
    assert!(matches!(
        run(alert_between, 100).await,
        Err(PeekError::Malformed(_))
    ));
}

/// A second hello, or any byte, after the ClientHello in its record would go
/// to the server unread (a hello for after a retry request the gateway
/// waits for in vain): malformed, in one record or at the end of many, and
/// for the second hello too.
#[tokio::test]
async fn bytes_after_the_hello_in_its_record_are_malformed() {
    let first = hello(Some("allowed.test"), &[], 0, false);
    let second = hello(Some("denied.test"), &[], 0, false);
    let malformed = Err(PeekError::Malformed(
        "bytes after the ClientHello in its record",
    ));
    for fragment in [16_384, 40] {
        let both = records(&[first.clone(), second.clone()].concat(), fragment);
        assert_eq!(run(both, 100).await.map(|x| x.0), malformed, "{fragment}");
        let one_more = records(&[first.clone(), vec![0]].concat(), fragment);
        assert_eq!(
            run(one_more, 100).await.map(|x| x.0),
            malformed,
            "{fragment}"
        );
        // The same hello ending at its record's end is read.
        let alone = records(&first, fragment);
        assert_eq!(
            run(alone, 100).await.map(|x| x.0),
            Ok(tls(Some("allowed.test")))
        );
    }
    let again = records(&[second.clone(), vec![1, 0, 0, 0]].concat(), 16_384);
    assert_eq!(
        crate::peek::second_client_hello(&again).map(|h| h.is_some()),
        Err(PeekError::Malformed(
            "bytes after the ClientHello in its record"
        ))
    );
}

/// A warning alert (or any other record) before the hello: a server may
/// drop it and take the hello after it, so the stream is no opaque one.
#[tokio::test]
async fn a_record_before_the_hello_is_malformed() {
    for kind in [0x14u8, 0x15, 0x17, 0x18] {
        // Any version a server may take on a first record: Go takes any
        // below 0x1000.
        for major in [3u8, 0, 2, 0x0f] {
            let mut stream = vec![kind, major, 1, 0, 2, 1, 0x5a];
            stream.extend(records(&hello(Some("other.test"), &[], 0, false), 16_384));
            let got = run(stream, 100).await;
            assert!(
                matches!(got, Err(PeekError::Malformed(_))),
                "{kind:#x} {major:#x}: {got:?}"
            );
        }
    }
    assert_eq!(classify_bytes(&[0x15]), Ok(None), "one byte: read on");
    let opaque = classify_bytes(&[0x15, 0x20, 0x20, 0x20]);
    assert!(
        matches!(opaque, Ok(Some(Classified::Opaque(_))) | Ok(None)),
        "{opaque:?}"
    );
}

/// Every way a server name can be read two ways, as `(what, hello)`.
fn two_reading_hellos() -> Vec<(&'static str, Vec<u8>)> {
    let sni = |entries: &[(u8, &[u8])]| (0x0000u16, sni_data(entries));
    let ok = sni(&[(0, b"allowed.test")]);
    let long = ["a".repeat(63).as_str(); 4].join(".");
    let mut list_too_long = sni_data(&[(0, b"allowed.test")]);
    list_too_long[1] += 1;
    let mut list_too_short = sni_data(&[(0, b"allowed.test")]);
    list_too_short.push(0);
    let mut name_overruns = sni_data(&[(0, b"allowed.test")]);
    name_overruns[4] += 1;
    let mut trailing = sni_data(&[(0, b"allowed.test")]);
    trailing.extend_from_slice(&[0, 0]);
    trailing[1] += 2;
    // A hello whose body has bytes after its extension block.
    let mut after_block = hello_with(std::slice::from_ref(&ok))[4..].to_vec();
    after_block.extend_from_slice(&[0, 0, 0, 0]);
    // A hello whose extension block's length overruns the message.
    let mut block_overruns = hello_with(std::slice::from_ref(&ok))[4..].to_vec();
    let at = block_overruns.len() - ok.1.len() - 6;
    block_overruns[at + 1] += 1;
    // One extension whose length overruns the block.
    let mut ext_overruns = hello_with(&[(0x0015, vec![0; 4]), ok.clone()])[4..].to_vec();
    let block_start = ext_overruns.len() - (4 + 4) - (4 + ok.1.len());
    ext_overruns[block_start + 2] = 0xff;
    vec![
        (
            "two server_name extensions",
            hello_with(&[ok.clone(), sni(&[(0, b"denied.test")])]),
        ),
        (
            "two server_name extensions, same name",
            hello_with(&[ok.clone(), ok.clone()]),
        ),
        (
            "two early_data extensions",
            hello_with(&[ok, (0x002a, vec![]), (0x002a, vec![])]),
        ),
        (
            "two host_name entries",
            hello_with(&[sni(&[(0, b"allowed.test"), (0, b"denied.test")])]),
        ),
        (
            "a non-host_name entry",
            hello_with(&[sni(&[(1, b"allowed.test")])]),
        ),
        (
            "a host_name after another entry type",
            hello_with(&[sni(&[(7, b"x"), (0, b"allowed.test")])]),
        ),
        ("an empty list", hello_with(&[(0x0000, vec![0, 0])])),
        ("an empty extension", hello_with(&[(0x0000, vec![])])),
        ("an empty name", hello_with(&[sni(&[(0, b"")])])),
        (
            "NUL",
            hello_with(&[sni(&[(0, b"denied.test\0.allowed.test")])]),
        ),
        (
            "NUL at the end",
            hello_with(&[sni(&[(0, b"allowed.test\0")])]),
        ),
        ("CR LF", hello_with(&[sni(&[(0, b"allowed.test\r\nx")])])),
        ("LF", hello_with(&[sni(&[(0, b"allowed.test\n")])])),
        (
            "a byte over 0x7f",
            hello_with(&[sni(&[(0, b"allow\xffed.test")])]),
        ),
        (
            "UTF-8",
            hello_with(&[sni(&[(0, "\u{e9}.test".as_bytes())])]),
        ),
        (
            "over 253 bytes",
            hello_with(&[sni(&[(0, long.as_bytes())])]),
        ),
        ("an underscore", hello_with(&[sni(&[(0, b"a_b.test")])])),
        ("a space", hello_with(&[sni(&[(0, b"allowed.test evil")])])),
        (
            "an IP literal with a trailing dot",
            hello_with(&[sni(&[(0, b"198.51.100.1.")])]),
        ),
        (
            "list length overruns",
            hello_with(&[(0x0000, list_too_long)]),
        ),
        (
            "list length short of the extension",
            hello_with(&[(0x0000, list_too_short)]),
        ),
        (
            "name length overruns",
            hello_with(&[(0x0000, name_overruns)]),
        ),
        (
            "trailing bytes in the list",
            hello_with(&[(0x0000, trailing)]),
        ),
        ("bytes after the extension block", handshake(&after_block)),
        ("extension block overruns", handshake(&block_overruns)),
        ("an extension overruns the block", handshake(&ext_overruns)),
    ]
}

#[tokio::test]
async fn a_server_name_that_reads_two_ways_is_malformed_however_it_is_cut() {
    for (what, hs) in two_reading_hellos() {
        for (fragment, step) in [(16_384, 4_096), (9, 1), (50, 7)] {
            let r = run(records(&hs, fragment), step).await;
            assert!(
                matches!(r, Err(PeekError::Malformed(_))),
                "{what} (fragment {fragment}, step {step}): {r:?}"
            );
        }
    }
}

#[tokio::test]
async fn the_flow_log_detail_names_the_irregularity() {
    let sni = |entries: &[(u8, &[u8])]| (0x0000u16, sni_data(entries));
    for (hs, why) in [
        (
            hello_with(&[sni(&[(0, b"a.test")]), sni(&[(0, b"b.test")])]),
            "two server_name extensions",
        ),
        (
            hello_with(&[sni(&[(0, b"a.test"), (0, b"b.test")])]),
            "more than one entry in the server_name list",
        ),
        (
            hello_with(&[sni(&[(0, b"a.test\0b")])]),
            "a NUL byte in the server name",
        ),
        (
            hello_with(&[sni(&[(0, b"a.test\r\n")])]),
            "CR or LF in the server name",
        ),
    ] {
        let e = run(records(&hs, 16_384), 4_096).await.expect_err(why);
        assert_eq!(e, PeekError::Malformed(why));
        assert!(e.to_string().contains(why), "{e}");
    }
}

#[tokio::test]
async fn no_sni_only_without_the_extension_or_with_one_ip_literal() {
    for (what, hs, expected) in [
        ("no extension", hello_with(&[]), None),
        (
            "no extensions at all",
            handshake(&hello_with(&[])[4..hello_with(&[]).len() - 2]),
            None,
        ),
        (
            "an IPv4 literal",
            hello_with(&[(0, sni_data(&[(0, b"198.51.100.7")]))]),
            None,
        ),
        (
            "an IPv6 literal",
            hello_with(&[(0, sni_data(&[(0, b"2001:db8::7")]))]),
            None,
        ),
        (
            "upper case and one trailing dot",
            hello_with(&[(0, sni_data(&[(0, b"Allowed.Test.")]))]),
            Some(name("allowed.test")),
        ),
    ] {
        let (c, _) = run(records(&hs, 16_384), 4_096).await.expect(what);
        assert_eq!(
            c,
            Classified::Tls(ClientHello {
                sni: expected,
                early_data: false,
                ech: false,
            }),
            "{what}"
        );
    }
}

#[tokio::test]
async fn hello_larger_than_the_limit_is_refused() {
    let bytes = records(&hello(Some("big.test"), &[], 12_000, false), 16_384);
    let mut t = Trickle {
        data: bytes,
        pos: 0,
        step: 1_000,
    };
    assert_eq!(
        peek(&mut t, 4_096, Duration::from_secs(5))
            .await
            .map(|x| x.0),
        Err(PeekError::TooLarge)
    );
}

#[tokio::test]
async fn http_request_heads() {
    let req = b"GET /x HTTP/1.1\r\nUser-Agent: t\r\nHOST: Api.Example.Test:8080\r\n\r\n".to_vec();
    let (c, read) = run(req.clone(), 3).await.expect("classified");
    assert_eq!(
        c,
        Classified::Http {
            host: Some(name("api.example.test"))
        }
    );
    assert_eq!(read, req);
    let (c, _) = run(b"POST / HTTP/1.0\r\n\r\n".to_vec(), 100)
        .await
        .expect("classified");
    assert_eq!(c, Classified::Http { host: None });
    // An IP literal names no domain.
    let (c, _) = run(
        b"GET / HTTP/1.1\r\nHost: [2001:db8::1]:80\r\n\r\n".to_vec(),
        100,
    )
    .await
    .expect("classified");
    assert_eq!(c, Classified::Http { host: None });
    // An absolute-form target that agrees with Host.
    let (c, _) = run(
        b"GET http://a.test/x HTTP/1.1\r\nHost: A.test\r\n\r\n".to_vec(),
        100,
    )
    .await
    .expect("classified");
    assert_eq!(c, tls_free_http("a.test"));
}

fn tls_free_http(host: &str) -> Classified {
    Classified::Http {
        host: Some(name(host)),
    }
}

/// A request head whose name claims could be read two ways is refused.
#[tokio::test]
async fn request_heads_with_two_readings_are_malformed() {
    for head in [
        &b"GET / HTTP/1.1\r\nHost: allowed.test\r\nHost: denied.test\r\n\r\n"[..],
        // The second Host hides behind a bare LF line ending.
        b"GET / HTTP/1.1\r\nHost: allowed.test\r\nX-A: b\nHost: denied.test\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: same.test\r\nhost: same.test\r\n\r\n",
        b"GET http://denied.test/ HTTP/1.1\r\nHost: allowed.test\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: allowed.test@denied.test\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: bad_name.test\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: \r\n\r\n",
        // RFC 9112 §3.2: HTTP/1.1 requires a Host.
        b"GET / HTTP/1.1\r\nUser-Agent: x\r\n\r\n",
    ] {
        let r = run(head.to_vec(), 7).await;
        assert!(
            matches!(r, Err(PeekError::MalformedRequest(_))),
            "{:?}: {r:?}",
            String::from_utf8_lossy(head)
        );
    }
}

/// What an origin's HTTP parser would take for a request is HTTP, and its
/// `Host` judged: read as opaque it would pass on the address's attribution,
/// whatever host it names.
#[tokio::test]
async fn anything_an_origin_reads_as_a_request_is_http() {
    for (what, head, host) in [
        (
            "empty lines first",
            &b"\r\nGET /x HTTP/1.1\r\nHost: evil.test\r\n\r\n"[..],
            Some("evil.test"),
        ),
        (
            "bare LFs first",
            b"\n\n\r\nGET /x HTTP/1.1\r\nHost: evil.test\r\n\r\n",
            Some("evil.test"),
        ),
        (
            "a listed method in lower case",
            b"delete /x HTTP/1.1\r\nHost: evil.test\r\n\r\n",
            Some("evil.test"),
        ),
        (
            "a method not in the list",
            b"PROPFIND /x HTTP/1.1\r\nHost: evil.test\r\n\r\n",
            Some("evil.test"),
        ),
        (
            "another method, in absolute form",
            b"PURGE Http://evil.test/x HTTP/1.1\r\nHost: evil.test\r\n\r\n",
            Some("evil.test"),
        ),
        (
            "another method, in asterisk form",
            b"MKCOL-2 * HTTP/1.1\r\nHost: evil.test\r\n\r\n",
            Some("evil.test"),
        ),
        (
            "the HTTP/2 preface",
            b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
            None,
        ),
        // nginx skips any CR or LF before the method; httparse refuses a
        // lone CR, so no Host is read (the request is answered 400).
        (
            "a lone CR first",
            b"\rGET /x HTTP/1.1\r\nHost: evil.test\r\n\r\n",
            None,
        ),
        (
            "an LF and a CR first",
            b"\n\rGET /x HTTP/1.1\r\nHost: evil.test\r\n\r\n",
            None,
        ),
        (
            "another method, in absolute form with another scheme",
            b"FOO x://evil.test/ HTTP/1.1\r\nHost: evil.test\r\n\r\n",
            Some("evil.test"),
        ),
        (
            "a method with a token's punctuation",
            b"X.Y /admin HTTP/1.1\r\nHost: evil.test\r\n\r\n",
            Some("evil.test"),
        ),
    ] {
        for step in [1, 4, 100] {
            let (c, read) = run(head.to_vec(), step).await.expect(what);
            assert_eq!(
                c,
                Classified::Http {
                    host: host.map(name)
                },
                "{what}, {step} bytes a read"
            );
            assert!(head.starts_with(&read), "{what}: what was read is replayed");
        }
    }
    // Lines that are not request lines stay opaque, as soon as they show it.
    for (what, bytes) in [
        ("a greeting", &b"HELLO there\r\n"[..]),
        // Words, unended: told at their first bytes, not left waiting (an
        // upper-case word's next word, at its end: it could be a scheme).
        ("words", b"hello echo"),
        ("a word", b"before"),
        ("an upper-case word and a word, ended", b"HELLO echo\r\n"),
        ("no version", b"FETCH /x\r\n"),
        ("another version", b"GET2 /x HTTPS/1.1\r\n"),
        ("a control byte in the target", b"FETCH /\x01 HTTP/1.1\r\n"),
    ] {
        let (c, _) = run(bytes.to_vec(), 1).await.expect(what);
        assert_eq!(c, Classified::Opaque(None), "{what}");
        // Decided by the bytes alone, before the stream ends.
        assert_eq!(
            classify_bytes(bytes),
            Ok(Some(Classified::Opaque(None))),
            "{what}"
        );
    }
    // Blanks before the method, tabs, runs of blanks: a server that splits
    // on any whitespace takes each for a request, so it is HTTP (which
    // hyper then refuses, 400), never opaque bytes with an unjudged Host.
    for (what, bytes) in [
        (
            "a space first",
            &b" GET /x HTTP/1.1\r\nHost: evil.test\r\n\r\n"[..],
        ),
        ("tabs", b"GET\t/x\tHTTP/1.1\r\nHost: evil.test\r\n\r\n"),
        (
            "two spaces",
            b"FETCH  /x HTTP/1.1\r\nHost: evil.test\r\n\r\n",
        ),
        (
            "a vertical tab",
            b"GET\x0b/x\x0bHTTP/1.1\r\nHost: evil.test\r\n\r\n",
        ),
        (
            "a form feed, a no-break space",
            b"GET\x0c/x\xa0HTTP/1.1\r\nHost: evil.test\r\n\r\n",
        ),
    ] {
        for step in [1, 4, 100] {
            let (c, _) = run(bytes.to_vec(), step).await.expect(what);
            assert_eq!(
                c,
                Classified::Http { host: None },
                "{what}, {step} bytes a read"
            );
        }
    }
    // A finished line that is no request, odd blanks or not, is opaque at
    // once, not left waiting for the peek's timeout.
    for bytes in [&b" GET\r\n"[..], b"\tPING\r\n", b"FETCH\t/x\r\n"] {
        assert_eq!(
            classify_bytes(bytes),
            Ok(Some(Classified::Opaque(None))),
            "{bytes:?}"
        );
    }
    // A request line the client closed after is HTTP; a prefix of one is no
    // request to any origin, and unreadable.
    let (c, _) = run(b"\r\nPROPFIND /x HTTP/1".to_vec(), 3)
        .await
        .expect("classified");
    assert_eq!(c, Classified::Http { host: None });
    let (c, _) = run(b"\r\nPROPFIND /x HT".to_vec(), 3)
        .await
        .expect("classified");
    assert_eq!(c, Classified::Opaque(None));
    // A request line longer than the peek's limit is HTTP: an origin reads on.
    let mut long = b"PROPFIND /".to_vec();
    long.extend(std::iter::repeat_n(b'a', 2_000));
    let mut io = std::io::Cursor::new(long);
    let (c, _) = peek(&mut io, 1_024, Duration::from_secs(1))
        .await
        .expect("classified");
    assert_eq!(c, Classified::Http { host: None });
    // A TLS 1.x hello in SSLv2 form carries no name the peek can read; its
    // first bytes alone are read on, whatever the cut.
    for cut in 1..4 {
        let prefix = [0x80, 0x2e, 0x01][..cut].to_vec();
        assert_eq!(classify_bytes(&prefix), Ok(None), "{prefix:?}");
    }
    let v2 = vec![0x80, 0x2e, 0x01, 0x03, 0x01, 0, 0x15, 0, 0, 0, 0x10];
    assert_eq!(
        run(v2, 64).await,
        Err(PeekError::Malformed("an SSLv2-compatible ClientHello"))
    );
}

#[tokio::test]
async fn opaque_bytes_and_silence() {
    let (c, read) = run(b"SSH-2.0-OpenSSH_9.6\r\n".to_vec(), 100)
        .await
        .expect("classified");
    assert_eq!(
        (c, read.len()),
        (Classified::Opaque(Some(StreamProtocol::Ssh)), 21)
    );
    let (c, _) = run(vec![0x00, 0x01, 0x02], 1).await.expect("classified");
    assert_eq!(c, Classified::Opaque(None));
    // An SSLv2-style hello: unreadable at its first byte.
    let (c, read) = run(vec![0x80, 0x2e, 0x01, 0x00, 0x02, 0, 0x15], 64)
        .await
        .expect("classified");
    assert_eq!((c, read.len()), (Classified::Opaque(None), 7));
    // A banner cut short by the client's close is unreadable.
    let (c, _) = run(b"SSH-2.0-Open".to_vec(), 3).await.expect("classified");
    assert_eq!(c, Classified::Opaque(None));
    // A banner and the client's next bytes, one byte at a time.
    let mut both = b"SSH-2.0-OpenSSH_9.6\r\n".to_vec();
    both.extend_from_slice(&[0, 0, 5, 0xdc, 8, 0x14]);
    let (c, read) = run(both, 1).await.expect("classified");
    assert_eq!(
        (c, read.len()),
        (Classified::Opaque(Some(StreamProtocol::Ssh)), 21)
    );
    assert_eq!(run(vec![], 1).await, Err(PeekError::Closed));
    // A silent client is dropped at the timeout.
    let (mut client, _server) = tokio::io::duplex(64);
    let r = peek(&mut client, 1024, Duration::from_millis(50)).await;
    assert_eq!(r, Err(PeekError::Timeout));
}

proptest::proptest! {
    /// Arbitrary bytes never panic the classifier.
    #[test]
    fn classify_never_panics(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..512)) {
        let _ = classify(&bytes);
        let mut tls = vec![0x16, 0x03, 0x01];
        tls.extend_from_slice(&bytes);
        let _ = classify(&tls);
    }
}

proptest::proptest! {
    /// The verdict on a hello — its name, or why it is malformed — is the
    /// same however its bytes are cut into records, up to 64 of them.
    #[test]
    fn verdict_does_not_depend_on_record_cuts(
        pick in 0usize..64,
        fragment in 1usize..400,
    ) {
        let mut hellos: Vec<Vec<u8>> = two_reading_hellos().into_iter().map(|(_, h)| h).collect();
        hellos.push(hello(Some("api.example.test"), &["h2"], 1_800, true));
        hellos.push(hello(None, &[], 0, false));
        let hs = &hellos[pick % hellos.len()];
        let whole = classify_bytes(&records(hs, 16_384));
        let cut = classify_bytes(&records(hs, fragment));
        if hs.len().div_ceil(fragment) <= MAX_HELLO_RECORDS {
            proptest::prop_assert_eq!(whole, cut);
        } else {
            proptest::prop_assert_eq!(
                cut,
                Err(PeekError::Malformed("a ClientHello in more than 64 records"))
            );
        }
    }
}
