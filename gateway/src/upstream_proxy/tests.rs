use std::time::Instant;

use tokio::net::TcpListener;

use super::*;

fn dst() -> SocketAddr {
    "203.0.113.10:443".parse().expect("addr")
}

fn config(text: &str) -> UpstreamProxyConfig {
    toml::from_str(text).expect(text)
}

#[test]
fn the_request_names_the_address_and_carries_basic_credentials() {
    assert_eq!(
        connect_request(dst(), None),
        "CONNECT 203.0.113.10:443 HTTP/1.1\r\nHost: 203.0.113.10:443\r\n\r\n"
    );
    let Authorization::Basic(auth) = basic("gw", "s3cret") else {
        panic!("basic")
    };
    assert_eq!(auth, "Basic Z3c6czNjcmV0");
    let v6: SocketAddr = "[2001:db8::1]:8443".parse().expect("addr");
    assert_eq!(
        connect_request(v6, Some(&auth)),
        "CONNECT [2001:db8::1]:8443 HTTP/1.1\r\nHost: [2001:db8::1]:8443\r\nProxy-Authorization: Basic Z3c6czNjcmV0\r\n\r\n"
    );
}

#[test]
fn the_head_ends_at_its_blank_line_however_it_is_split() {
    let wire = b"HTTP/1.1 200 Connection established\r\nVia: x\r\n\r\nSSH-2.0-origin\r\n";
    let head_len = wire.len() - b"SSH-2.0-origin\r\n".len();
    // Every split into what was consumed before and what a peek shows now.
    for split in 0..head_len {
        let (before, now) = wire.split_at(split);
        assert_eq!(
            end_of_head(before, now),
            Some(head_len - split),
            "split at {split}"
        );
    }
    assert_eq!(end_of_head(b"", b"HTTP/1.0 200 OK\n\nrest"), Some(17));
    assert_eq!(end_of_head(b"", b"HTTP/1.1 200 OK\r\nVia: x\r\n"), None);
    assert_eq!(end_of_head(b"HTTP/1.1 200 OK\r\n", b"\r"), None);
}

#[test]
fn only_a_2xx_opens_the_tunnel() {
    assert!(tunnel_status(b"HTTP/1.1 200 Connection established\r\n\r\n", dst()).is_ok());
    assert!(tunnel_status(b"HTTP/1.0 204 No Content\r\n\r\n", dst()).is_ok());
    let refused = tunnel_status(
        b"HTTP/1.1 407 Proxy Authentication Required\r\nProxy-Authenticate: Basic\r\n\r\n",
        dst(),
    )
    .expect_err("407");
    assert_eq!(refused.result(), "refused");
    assert_eq!(
        refused.to_string(),
        "refused CONNECT 203.0.113.10:443: 407 Proxy Authentication Required"
    );
    let garbage = tunnel_status(b"SSH-2.0-x\r\n\r\n", dst()).expect_err("not HTTP");
    assert_eq!(garbage.result(), "bad_response");
}

#[test]
fn configuration_errors_name_the_key() {
    let ok = config(
        r#"
        default = "corp"
        [proxies.corp]
        address = "203.0.113.8:3128"
        username = "gw"
        password_file = "/etc/egress-gateway/proxy-password"
        [proxies.lab]
        address = "[2001:db8::8]:3128"
        "#,
    );
    assert_eq!(ok.first_invalid(), None);
    let cases = [
        (
            "default = \"nope\"",
            "upstream_proxy.default",
            "\"nope\" names no proxy",
        ),
        (
            "[proxies.direct]\naddress = \"203.0.113.8:3128\"",
            "upstream_proxy.proxies",
            "reserved",
        ),
        (
            "[proxies.corp]\naddress = \"203.0.113.8:3128\"\npassword_file = \"/p\"",
            "upstream_proxy.proxies",
            "corp: password_file needs a username",
        ),
        (
            "[proxies.corp]\naddress = \"203.0.113.8:3128\"\nusername = \"a:b\"",
            "upstream_proxy.proxies",
            "username \"a:b\"",
        ),
        (
            "[proxies.corp]\naddress = \"0.0.0.0:3128\"",
            "upstream_proxy.proxies",
            "corp: address 0.0.0.0:3128",
        ),
    ];
    for (text, key, needle) in cases {
        let (k, why) = config(text).first_invalid().expect(text);
        assert_eq!(k, key, "{text}");
        assert!(why.contains(needle), "{text}: {why}");
    }
    for text in [
        "[proxies.corp]\naddress = \"proxy.corp.example:3128\"",
        "[proxies.corp]\naddress = \"203.0.113.8:3128\"\nport = 1",
    ] {
        assert!(
            toml::from_str::<UpstreamProxyConfig>(text).is_err(),
            "{text}"
        );
    }
}

#[test]
fn a_sandbox_chooses_direct_a_proxy_or_the_default() {
    let proxies = UpstreamProxies::new(&config(
        "default = \"corp\"\n[proxies.corp]\naddress = \"203.0.113.8:3128\"\n[proxies.lab]\naddress = \"203.0.113.9:3128\"",
    ));
    let name = |r: Route| match r {
        Route::Direct => "direct".to_owned(),
        Route::Via(p) => p.name.to_string(),
        Route::Missing(n) => format!("missing {n}"),
    };
    let choice = |s: &str| ProxyChoice::try_from(s.to_owned()).expect(s);
    assert_eq!(name(proxies.route(None)), "corp");
    assert_eq!(name(proxies.route(Some(&choice("direct")))), "direct");
    assert_eq!(name(proxies.route(Some(&choice("lab")))), "lab");
    assert_eq!(name(proxies.route(Some(&choice("gone")))), "missing gone");
    assert!(proxies.check(&choice("lab")).is_ok());
    assert!(proxies.check(&choice("direct")).is_ok());
    let e = proxies.check(&choice("gone")).expect_err("unknown");
    assert!(e.contains("upstream_proxy \"gone\""), "{e}");
    assert!(ProxyChoice::try_from("no way".to_owned()).is_err());
    let none = UpstreamProxies::new(&UpstreamProxyConfig::default());
    assert_eq!(name(none.route(None)), "direct");
}

#[test]
fn passwords_are_read_again_and_never_shown() {
    let dir = tempfile::tempdir().expect("dir");
    let file = dir.path().join("pw");
    std::fs::write(&file, "s3cret\n").expect("write");
    let text = format!(
        "[proxies.corp]\naddress = \"203.0.113.8:3128\"\nusername = \"gw\"\npassword_file = {:?}",
        file.display().to_string()
    );
    let proxies = UpstreamProxies::new(&config(&text));
    let Route::Via(corp) = proxies.route(Some(
        &ProxyChoice::try_from("corp".to_owned()).expect("name"),
    )) else {
        panic!("corp")
    };
    assert!(
        matches!(&**corp.authorization.load(), Authorization::Unavailable),
        "nothing before the first read"
    );
    assert!(proxies.reload().is_empty());
    assert!(
        matches!(&**corp.authorization.load(), Authorization::Basic(v) if v == "Basic Z3c6czNjcmV0")
    );
    assert!(!format!("{corp:?}").contains("Z3c6"), "{corp:?}");
    for empty in ["", "\n", "\r\n"] {
        std::fs::write(&file, empty).expect("truncate");
        let failed = proxies.reload();
        assert_eq!(failed.len(), 1, "{empty:?} was taken for a password");
        assert!(
            failed[0].starts_with("corp: ") && failed[0].contains("empty"),
            "{failed:?}"
        );
        assert!(matches!(
            &**corp.authorization.load(),
            Authorization::Unavailable
        ));
    }
    std::fs::remove_file(&file).expect("rm");
    let failed = proxies.reload();
    assert_eq!(failed.len(), 1);
    assert!(failed[0].starts_with("corp: "), "{failed:?}");
    assert!(matches!(
        &**corp.authorization.load(),
        Authorization::Unavailable
    ));
}

// === over real sockets ===

/// A one-shot proxy on loopback: reads the request head, answers `answer`,
/// then (for a 2xx) sends `origin_first` as the origin would, and hands
/// back the head it got.
async fn proxy(
    answer: &'static [u8],
    origin_first: &'static [u8],
) -> (Arc<Proxy>, tokio::task::JoinHandle<String>) {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let address = l.local_addr().expect("addr");
    let task = tokio::spawn(async move {
        let (mut s, _) = l.accept().await.expect("accept");
        let mut head = Vec::new();
        let mut b = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            if s.read(&mut b).await.unwrap_or(0) == 0 {
                break;
            }
            head.push(b[0]);
        }
        // The answer and the origin's first bytes in one write: the
        // gateway must still not take the latter as part of the head.
        let mut out = answer.to_vec();
        out.extend_from_slice(origin_first);
        if answer == b"SILENT" {
            tokio::time::sleep(Duration::from_secs(5)).await;
        } else {
            let _ = s.write_all(&out).await;
        }
        String::from_utf8_lossy(&head).into_owned()
    });
    let p = Proxy {
        name: ProxyName::parse("corp").expect("name"),
        address,
        username: Some("gw".into()),
        password_file: None,
        authorization: ArcSwap::from_pointee(basic("gw", "s3cret")),
    };
    (Arc::new(p), task)
}

#[tokio::test]
async fn bytes_behind_the_200_reach_the_caller_intact() {
    let (p, seen) = proxy(
        b"HTTP/1.1 200 Connection established\r\n\r\n",
        b"SSH-2.0-origin\r\n",
    )
    .await;
    let mut tcp = connect(&p, dst(), Duration::from_secs(2))
        .await
        .expect("tunnel");
    let mut first = [0u8; 16];
    tcp.read_exact(&mut first).await.expect("origin bytes");
    assert_eq!(&first, b"SSH-2.0-origin\r\n");
    let head = seen.await.expect("proxy");
    assert!(
        head.starts_with("CONNECT 203.0.113.10:443 HTTP/1.1\r\n"),
        "{head}"
    );
    assert!(head.contains("Host: 203.0.113.10:443\r\n"), "{head}");
    assert!(
        head.contains("Proxy-Authorization: Basic Z3c6czNjcmV0\r\n"),
        "{head}"
    );
}

#[tokio::test]
async fn refusals_closes_and_silence_fail_within_the_timeout() {
    let (p, _) = proxy(b"HTTP/1.1 407 Proxy Authentication Required\r\n\r\n", b"").await;
    let e = connect(&p, dst(), Duration::from_secs(2))
        .await
        .expect_err("407");
    assert!(
        matches!(e, ProxyFailure::Refused { status: 407, .. }),
        "{e}"
    );

    let (p, _) = proxy(b"HTTP/1.1 200 Conn", b"").await;
    let e = connect(&p, dst(), Duration::from_secs(2))
        .await
        .expect_err("closed");
    assert_eq!(e.result(), "closed", "{e}");

    let (p, _) = proxy(b"SILENT", b"").await;
    let started = Instant::now();
    let e = connect(&p, dst(), Duration::from_millis(300))
        .await
        .expect_err("silent");
    assert_eq!(e.result(), "timeout", "{e}");
    assert!(started.elapsed() < Duration::from_secs(2));

    let nobody = {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        l.local_addr().expect("addr")
    };
    let gone = Proxy {
        address: nobody,
        ..Arc::try_unwrap(p).expect("one owner")
    };
    let e = connect(&gone, dst(), Duration::from_secs(2))
        .await
        .expect_err("refused");
    assert_eq!(e.result(), "unreachable", "{e}");
}
