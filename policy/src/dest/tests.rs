use proptest::prelude::*;

use super::*;

fn parse_json(text: &str) -> Result<Destination, String> {
    serde_json::from_str::<Destination>(text).map_err(|e| e.to_string())
}

#[test]
fn each_kind_in_normal_form() {
    let cases = [
        (r#"{"ip": "203.0.113.7"}"#, r#"{"ip":"203.0.113.7"}"#),
        (r#"{"ip": "2001:DB8::0:1"}"#, r#"{"ip":"2001:db8::1"}"#),
        (r#"{"ip": "::ffff:203.0.113.7"}"#, r#"{"ip":"203.0.113.7"}"#),
        (
            r#"{"cidr": "198.51.100.0/24"}"#,
            r#"{"cidr":"198.51.100.0/24"}"#,
        ),
        (
            r#"{"cidr": "2001:db8::/32"}"#,
            r#"{"cidr":"2001:db8::/32"}"#,
        ),
        (
            r#"{"cidr": "::ffff:198.51.100.0/120"}"#,
            r#"{"cidr":"198.51.100.0/24"}"#,
        ),
        (
            r#"{"domain": "Api.Example.Test."}"#,
            r#"{"domain":"api.example.test"}"#,
        ),
        (
            r#"{"wildcard_domain": "*.Relay.example.test"}"#,
            r#"{"wildcard_domain":"*.relay.example.test"}"#,
        ),
    ];
    for (input, normal) in cases {
        let d = parse_json(input).expect(input);
        assert_eq!(
            serde_json::to_string(&d).expect("serialises"),
            normal,
            "{input}"
        );
    }
}

#[test]
fn errors_name_the_value_and_what_is_expected() {
    let cases = [
        (
            r#"{"ip": "203.0.113.0/24"}"#,
            "invalid ip \"203.0.113.0/24\": expected an IPv4 or IPv6 address",
        ),
        (r#"{"ip": "example.test"}"#, "invalid ip \"example.test\""),
        (
            r#"{"cidr": "203.0.113.0"}"#,
            "invalid cidr \"203.0.113.0\": expected address/prefix-length",
        ),
        (
            r#"{"cidr": "203.0.113.0/33"}"#,
            "invalid cidr \"203.0.113.0/33\"",
        ),
        // Read as octal by inet_aton, as decimal by ipnet: refused as `ip` is.
        (r#"{"cidr": "010.0.0.0/8"}"#, "invalid cidr \"010.0.0.0/8\""),
        (r#"{"cidr": "10.0.0.0/08"}"#, "invalid cidr \"10.0.0.0/08\""),
        (
            r#"{"cidr": "::ffff:010.0.0.0/104"}"#,
            "invalid cidr \"::ffff:010.0.0.0/104\"",
        ),
        (
            r#"{"cidr": "192.0.2.1/24"}"#,
            "cidr \"192.0.2.1/24\" has host bits set: did you mean \"192.0.2.0/24\"?",
        ),
        (
            r#"{"cidr": "2001:db8::1/32"}"#,
            "did you mean \"2001:db8::/32\"?",
        ),
        (
            r#"{"domain": "203.0.113.7"}"#,
            "invalid domain \"203.0.113.7\": an IP literal is not a hostname",
        ),
        (
            r#"{"domain": "bücher.test"}"#,
            "use the xn-- (punycode) form",
        ),
        (
            r#"{"domain": "*.example.test"}"#,
            "invalid domain \"*.example.test\"",
        ),
        (
            r#"{"wildcard_domain": "relay.example.test"}"#,
            "invalid wildcard_domain \"relay.example.test\"",
        ),
        (
            r#"{"wildcard_domain": "a.*.example.test"}"#,
            "invalid wildcard_domain",
        ),
        (
            r#"{"host": "example.test"}"#,
            "unsupported selector \"host\": expected one of ip, cidr, domain, wildcard_domain",
        ),
        (
            r#"{"domain": "a.test", "port": 443}"#,
            "unsupported selector \"port\"",
        ),
        (r#"{}"#, "exactly one of ip, cidr, domain, wildcard_domain"),
        (r#""a.test""#, "expected an object with exactly one of"),
    ];
    for (input, needle) in cases {
        let err = parse_json(input).expect_err(input);
        assert!(err.contains(needle), "{input}: {err:?} lacks {needle:?}");
    }
}

#[test]
fn restricted_contexts_refuse_other_kinds() {
    let err = serde_json::from_str::<ProfileDestination>(r#"{"wildcard_domain": "*.a.test"}"#)
        .expect_err("profiles take no wildcards")
        .to_string();
    assert!(
        err.contains(
            "wildcard_domain destinations are not accepted here: expected one of ip, cidr, domain"
        ),
        "{err}"
    );
    for bad in [r#"{"ip": "203.0.113.7"}"#, r#"{"cidr": "203.0.113.0/24"}"#] {
        let err = serde_json::from_str::<ExemptionDestination>(bad)
            .expect_err(bad)
            .to_string();
        assert!(
            err.contains("expected one of domain, wildcard_domain"),
            "{err}"
        );
    }
    let ok =
        serde_json::from_str::<ExemptionDestination>(r#"{"domain": "A.test"}"#).expect("domain ok");
    assert_eq!(ok.get().to_string(), "domain a.test");
    let d = Destination::parse(Kind::WildcardDomain, "*.a.test").expect("valid");
    assert!(ProfileDestination::try_from(d.clone()).is_err());
    assert!(ExemptionDestination::try_from(d).is_ok());
}

#[test]
fn embedded_ipv4_forms() {
    let e = |s: &str| embedded_ipv4(s.parse().expect(s));
    assert_eq!(
        e("::ffff:169.254.169.254"),
        Some(Ipv4Addr::new(169, 254, 169, 254))
    );
    assert_eq!(
        e("64:ff9b::a9fe:a9fe"),
        Some(Ipv4Addr::new(169, 254, 169, 254))
    );
    assert_eq!(e("64:ff9b:1::a9fe:a9fe"), None, "only the well-known /96");
    assert_eq!(e("2001:db8::1"), None);
    assert_eq!(e("169.254.169.254"), None);
}

fn arb_destination() -> impl Strategy<Value = Destination> {
    let label = "[a-zA-Z0-9]([a-zA-Z0-9-]{0,10}[a-zA-Z0-9])?";
    let name = prop::collection::vec(label, 1..4).prop_map(|v| format!("{}.test", v.join(".")));
    prop_oneof![
        any::<std::net::IpAddr>().prop_map(|ip| Destination::parse(Kind::Ip, &ip.to_string())),
        (any::<std::net::Ipv4Addr>(), 0u8..=32).prop_map(|(ip, len)| {
            let net = ipnet::Ipv4Net::new(ip, len).expect("len <= 32").trunc();
            Destination::parse(Kind::Cidr, &net.to_string())
        }),
        (any::<std::net::Ipv6Addr>(), 0u8..=128).prop_map(|(ip, len)| {
            let net = ipnet::Ipv6Net::new(ip, len).expect("len <= 128").trunc();
            Destination::parse(Kind::Cidr, &net.to_string())
        }),
        name.clone()
            .prop_map(|n| Destination::parse(Kind::Domain, &format!("{n}."))),
        name.prop_map(|n| Destination::parse(Kind::WildcardDomain, &format!("*.{n}"))),
    ]
    .prop_filter_map("valid", Result::ok)
}

proptest! {
    /// Normal form is a fixed point: printing and parsing again changes nothing.
    #[test]
    fn normal_form_is_idempotent(d in arb_destination()) {
        let once = serde_json::to_string(&d).expect("serialises");
        let back: Destination = serde_json::from_str(&once).expect("normal form parses");
        prop_assert_eq!(&back, &d);
        prop_assert_eq!(serde_json::to_string(&back).expect("serialises"), once);
    }

    /// Arbitrary input never panics the parser, and whatever it accepts is stable.
    #[test]
    fn any_string_parses_or_fails_cleanly(s in "\\PC{0,40}", k in 0usize..4) {
        let kind = [Kind::Ip, Kind::Cidr, Kind::Domain, Kind::WildcardDomain][k];
        if let Ok(d) = Destination::parse(kind, &s) {
            prop_assert_eq!(Destination::parse(kind, &d.value()).expect("stable"), d);
        }
    }
}
