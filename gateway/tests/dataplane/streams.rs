//! Streams the gateway cannot read, under `policy.opaque_streams`: with
//! `deny`, an SSLv2-style hello to an allowed address is refused
//! `unreadable_stream` (and counted), while an SSH banner to an entry that
//! names `ssh` passes; with the default `allow`, both pass as before.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use crate::harness::*;

/// Origins of their own (loopback addresses no other test uses).
const SSH_IP: &str = "127.0.0.16";
const LEGACY_IP: &str = "127.0.0.17";

/// The first bytes of an SSLv2-compatible ClientHello (what testssl.sh probes with).
const SSLV2_HELLO: &[u8] = &[
    0x80, 0x2e, 0x01, 0x00, 0x02, 0x00, 0x15, 0x00, 0x00, 0x00, 0x10, 0x07, 0x00, 0xc0,
];
const SSH_BANNER: &[u8] = b"SSH-2.0-OpenSSH_9.6p1 Ubuntu-3ubuntu13.5\r\n";

/// A TCP origin echoing what it reads.
pub async fn echo_origin(ip: &str) -> SocketAddr {
    let listener = TcpListener::bind((ip.parse::<IpAddr>().expect("ip"), 0))
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((mut tcp, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 1024];
                while let Ok(n) = tcp.read(&mut buf).await {
                    if n == 0 || tcp.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
            });
        }
    });
    addr
}

/// Writes `bytes` from sandbox A to `dst` and reads the echo: `Some(echo)`
/// when the flow passed, `None` when the gateway closed it.
async fn send(e: &Env, dst: SocketAddr, bytes: &[u8]) -> Option<Vec<u8>> {
    let mut s = e.connect(SANDBOX_A, dst).await;
    s.write_all(bytes).await.expect("write");
    let mut echo = vec![0u8; bytes.len()];
    match tokio::time::timeout(Duration::from_secs(3), s.read_exact(&mut echo)).await {
        Ok(Ok(_)) => Some(echo),
        _ => None,
    }
}

fn streams_policy() -> egress_policy::Policy {
    policy(&format!(
        r#"{{"default": "deny", "allow": [{{"ip": "{SSH_IP}", "streams": ["ssh"]}}, {{"cidr": "{LEGACY_IP}/32"}}]}}"#
    ))
}

#[tokio::test]
async fn with_opaque_streams_deny_only_named_protocols_pass() {
    let e = env(Options {
        opaque_streams: "deny",
        ..Options::default()
    })
    .await;
    e.sandbox("a", SANDBOX_A, streams_policy());
    let ssh = echo_origin(SSH_IP).await;
    let legacy = echo_origin(LEGACY_IP).await;

    assert_eq!(
        send(&e, legacy, SSLV2_HELLO).await,
        None,
        "unreadable: refused"
    );
    assert_eq!(
        send(&e, ssh, SSH_BANNER).await.as_deref(),
        Some(SSH_BANNER),
        "an entry naming ssh lets SSH through"
    );
    assert_eq!(send(&e, ssh, SSLV2_HELLO).await, None, "ssh only");
    assert_eq!(
        send(&e, legacy, SSH_BANNER).await,
        None,
        "an entry without streams lets none through under deny"
    );

    let lines = e.flow_lines(4).await;
    let seen: Vec<_> = lines
        .iter()
        .map(|l| {
            (
                l["dst"].as_str().unwrap_or_default().to_owned(),
                l["protocol"].clone(),
                l["verdict"].clone(),
                l["reason"].clone(),
            )
        })
        .collect();
    let row = |dst: SocketAddr, p: &str, v: &str, r: &str| {
        (dst.to_string(), json!(p), json!(v), json!(r))
    };
    for expected in [
        row(legacy, "opaque", "deny", "unreadable_stream"),
        row(ssh, "ssh", "allow", "allow_address"),
        row(ssh, "opaque", "deny", "unreadable_stream"),
        row(legacy, "ssh", "deny", "unreadable_stream"),
    ] {
        assert!(seen.contains(&expected), "{expected:?} not in {seen:?}");
    }
    let refused = lines
        .iter()
        .find(|l| l["reason"] == json!("unreadable_stream") && l["protocol"] == json!("opaque"))
        .expect("refused line");
    assert!(
        refused["detail"]
            .as_str()
            .unwrap_or_default()
            .contains("opaque_streams is deny"),
        "{refused}"
    );
    assert_eq!(
        value(
            &e,
            r#"egress_flows_total{verdict="deny",reason="unreadable_stream"}"#
        )
        .await,
        3
    );
    // Explain agrees, told what the stream is.
    for (dst, stream, reason) in [
        (ssh, Some("ssh"), "allow_address"),
        (ssh, None, "unreadable_stream"),
        (legacy, Some("ssh"), "unreadable_stream"),
        (legacy, None, "unreadable_stream"),
    ] {
        let mut q = json!({"sandbox": "a", "dst": dst.to_string()});
        if let Some(s) = stream {
            q["stream"] = json!(s);
        }
        let answer = crate::explain::explain(&e, q).await;
        assert_eq!(
            answer["reason"],
            json!(reason),
            "{dst} {stream:?}: {answer}"
        );
    }
}

#[tokio::test]
async fn by_default_an_address_allow_lets_every_stream_through() {
    let e = env(Options::default()).await;
    e.sandbox("a", SANDBOX_A, streams_policy());
    let ssh = echo_origin(SSH_IP).await;
    let legacy = echo_origin(LEGACY_IP).await;
    assert_eq!(
        send(&e, legacy, SSLV2_HELLO).await.as_deref(),
        Some(SSLV2_HELLO),
        "the seed's meaning: an address allow allows the stream"
    );
    assert_eq!(
        send(&e, legacy, SSH_BANNER).await.as_deref(),
        Some(SSH_BANNER)
    );
    assert_eq!(send(&e, ssh, SSH_BANNER).await.as_deref(), Some(SSH_BANNER));
    // An entry that names its streams lets only those through, whatever the setting.
    assert_eq!(send(&e, ssh, SSLV2_HELLO).await, None);
    let lines = e.flow_lines(4).await;
    let protocols: Vec<_> = lines.iter().map(|l| l["protocol"].clone()).collect();
    assert_eq!(
        protocols.iter().filter(|p| **p == json!("ssh")).count(),
        2,
        "{lines:?}"
    );
}

/// An origin no other test uses, writing as much as it may.
const FIREHOSE_IP: &str = "127.0.0.41";

/// A spliced stream cut at the idle timeout with bytes the gateway read
/// and could not pass on (its client stopped reading) is reset, not closed:
/// closed, its client would read a shorter stream ending as a whole one.
/// Before, the idle timeout closed it with a FIN. One idle with nothing
/// held is closed, as before.
#[tokio::test]
async fn a_stream_cut_idle_with_bytes_undelivered_is_reset() {
    let e = env(Options {
        idle: "1s",
        ..Options::default()
    })
    .await;
    let allowed = format!(r#"{{"allow": [{{"ip": "{FIREHOSE_IP}"}}]}}"#);
    e.sandbox("a", SANDBOX_A, policy(&allowed));
    let listener = TcpListener::bind((FIREHOSE_IP.parse::<IpAddr>().expect("ip"), 0))
        .await
        .expect("bind");
    let origin = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        if let Ok((mut tcp, _)) = listener.accept().await {
            let chunk = vec![b'f'; 64 * 1024];
            // 64 MiB at most: far more than the sockets between hold.
            for _ in 0..1024 {
                if tcp.write_all(&chunk).await.is_err() {
                    return;
                }
            }
        }
    });
    let mut s = e.connect(SANDBOX_A, origin).await;
    s.write_all(b"go").await.expect("write");
    // Not read for past the idle timeout: the copy toward it stalls.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let mut got = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut got)).await;
    let read = read.expect("ended");
    assert!(
        read.is_err(),
        "closed as a whole stream after {} bytes",
        got.len()
    );
    let line = &e.flow_lines(1).await[0];
    assert_eq!(line["error"], json!("idle_timeout"), "{line}");
    // Idle with nothing held (an echo answered in full): closed, as before.
    let echo = echo_origin(FIREHOSE_IP).await;
    let mut s = e.connect(SANDBOX_A, echo).await;
    s.write_all(b"ping").await.expect("write");
    let mut pong = [0u8; 4];
    s.read_exact(&mut pong).await.expect("echoed");
    let mut rest = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut rest)).await;
    assert!(matches!(read, Ok(Ok(0))), "{read:?}");
}
