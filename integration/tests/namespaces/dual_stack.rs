//! Every verdict path over IPv6 as over IPv4: the sandboxes are dual stack,
//! the fake resolver answers AAAA, origins listen on 2001:db8:f::/48, and
//! the gateway's transparent listener is `[::]:15001` (IPv4 arrives on it
//! as `::ffff:a.b.c.d`, so every other namespace test exercises that too).

use serde_json::json;

use crate::topology::{available, Topology, SB1_IP, SB1_IP6};

const POLICY: &str = r#"{"default": "deny", "tls_interception": "on",
    "allow": [{"ip": "8.8.8.8"}, {"domain": "api.example.test"}, {"wildcard_domain": "*.relay.example.test"},
              {"cidr": "2001:db8:f::100:0/112"}, {"cidr": "fd00::/8"}, {"cidr": "fe80::/10"}],
    "tls_interception_exemptions": [{"wildcard_domain": "*.relay.example.test"}]}"#;

#[test]
fn every_verdict_path_over_ipv6() {
    if !available() {
        return;
    }
    let t = Topology::new();
    t.push("sb1", SB1_IP, POLICY);

    // AAAA through the reserved resolver, then HTTPS over IPv6: intercepted
    // (only the gateway's CA verifies), the origin sees the request.
    let aaaa = t.exec(
        &t.sb1,
        "dig",
        &[
            "+short",
            "+time=3",
            "+tries=1",
            "@8.8.8.8",
            "AAAA",
            "api.example.test",
        ],
    );
    assert!(
        String::from_utf8_lossy(&aaaa.stdout).contains("2001:db8:f::10"),
        "{aaaa:?}"
    );
    let (code, body) = t.curl(&t.sb1, "gateway", "https://api.example.test/hello", &["-6"]);
    assert_eq!(code, 0, "{body}");
    assert!(
        body.contains("fake internet: GET /hello host=api.example.test"),
        "{body}"
    );

    // An exempted name, attributed over IPv6: spliced, the origin's own certificate.
    let (code, body) = t.curl(&t.sb1, "origin", "https://a.relay.example.test/", &["-6"]);
    assert_eq!(code, 0, "spliced: {body}");

    // A name the policy does not allow: denied (the connection is reset).
    let (code, _) = t.curl(&t.sb1, "gateway", "https://other.example.test/", &["-6"]);
    assert_ne!(code, 0, "denied over IPv6");

    // An IPv6 CIDR allow, plain HTTP.
    let (code, body) = t.curl(&t.sb1, "gateway", "http://plain.example.test/", &["-6"]);
    assert_eq!(code, 0, "{body}");
    assert!(body.contains("host=plain.example.test"), "{body}");

    // Platform denies win over the policy's allows: IPv6 metadata (fd00:ec2::254,
    // also inside the allowed fd00::/8), ULA, and link-local (the gateway's own
    // link-local address on the sandbox's link).
    for url in [
        "http://[fd00:ec2::254]/latest/meta-data/",
        "http://[fd12:3456::1]/",
    ] {
        let (code, body) = t.curl(&t.sb1, "gateway", url, &["-w", "%{http_code}"]);
        assert_eq!(code, 0, "{url}: {body}");
        assert!(
            body.contains("403") && body.contains("platform deny"),
            "{url}: {body}"
        );
    }
    // The gateway's link-local address, asked from sb1's registered address
    // (the kernel would pick sb1's own link-local source once its duplicate
    // address detection ends, and that source is no sandbox's).
    let ll = t.link_local(&t.gw, "sb1");
    let url = format!("http://[{ll}%eth0]:8080/");
    let pinned = ["-w", "%{http_code}", "-g", "--interface", SB1_IP6];
    let (code, body) = t.curl(&t.sb1, "gateway", &url, &pinned);
    assert_eq!(code, 0, "{url}: {body}");
    assert!(
        body.contains("403") && body.contains("platform deny"),
        "{url}: {body}"
    );

    // The flow log names IPv6 destinations and the same reasons as IPv4.
    let v6_of = |flows: &[serde_json::Value]| -> Vec<serde_json::Value> {
        flows
            .iter()
            .filter(|f| f["dst"].as_str().is_some_and(|d| d.starts_with('[')))
            .cloned()
            .collect()
    };
    // The link-local refusal is the last flow: wait for its line.
    let flows = t.flows_when(|f| {
        v6_of(f)
            .iter()
            .any(|l| l["dst"].as_str().is_some_and(|d| d.starts_with("[fe80::")))
    });
    let v6 = v6_of(&flows);
    let has = |verdict: &str, dst_prefix: &str| {
        v6.iter().any(|f| {
            f["verdict"] == json!(verdict)
                && f["dst"].as_str().is_some_and(|d| d.starts_with(dst_prefix))
        })
    };
    assert!(has("intercept", "[2001:db8:f::10]"), "{v6:?}");
    assert!(has("splice", "[2001:db8:f::20]"), "{v6:?}");
    assert!(has("deny", "[2001:db8:f::11]"), "{v6:?}");
    assert!(has("deny", "[fd00:ec2::254]"), "{v6:?}");
    assert!(has("deny", "[fe80::"), "{v6:?}");
    // The sandbox was identified by its IPv6 source address.
    assert!(v6.iter().all(|f| f["sandbox"] == json!("sb1")), "{v6:?}");
    // IPv4 still works through the dual-stack listener, from the same sandbox.
    let (code, body) = t.curl(&t.sb1, "gateway", "https://api.example.test/v4", &["-4"]);
    assert_eq!(code, 0, "{body}");
    let from_v4 = |f: &serde_json::Value| {
        f["src"]
            .as_str()
            .is_some_and(|s| s.starts_with("100.64.1.2:"))
    };
    assert!(t.flows_when(|f| f.iter().any(from_v4)).iter().any(from_v4));
}
