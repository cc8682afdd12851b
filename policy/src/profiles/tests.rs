use super::*;

fn parse(text: &str) -> Result<Profiles, ProfilesError> {
    Profiles::from_env_value(Some(text))
}

const EXAMPLE: &str = r#"{
  "audit": {
    "default": true,
    "allow": [{"domain": "audit.example.test"}]
  },
  "sensor": {
    "allow": [{"domain": "sensor.example.test"}, {"cidr": "192.0.2.0/24"}],
    "tls_interception_exemptions": [{"domain": "sensor.example.test"}]
  }
}"#;

#[test]
fn spec_example_parses_with_defaults_filled_in() {
    let p = parse(EXAMPLE).expect("spec example is valid");
    assert!(p.is_enabled());
    assert_eq!(p.len(), 2);
    let audit = p.get("audit").expect("audit");
    assert!(audit.default);
    assert!(
        audit.tls_interception_exemptions.is_empty(),
        "exemptions default to empty"
    );
    let sensor = p.get("sensor").expect("sensor");
    assert!(!sensor.default, "default defaults to false");
    assert_eq!(sensor.allow.len(), 2);
    assert_eq!(
        sensor.tls_interception_exemptions[0].get().to_string(),
        "domain sensor.example.test"
    );
    assert_eq!(
        p.defaults().map(ProfileName::as_str).collect::<Vec<_>>(),
        ["audit"]
    );
}

#[test]
fn unset_and_empty_object_disable() {
    assert!(!Profiles::from_env_value(None).expect("unset").is_enabled());
    assert!(!parse("{}").expect("{}").is_enabled());
    assert!(!parse(" { } ").expect("{} with spaces").is_enabled());
}

#[test]
fn ip_and_cidr_and_domain_accepted_in_both_lists() {
    let p = parse(
        r#"{"a": {"allow": [{"ip": "203.0.113.7"}, {"cidr": "2001:db8::/32"}, {"domain": "a.test"}],
                 "tls_interception_exemptions": [{"ip": "203.0.113.7"}, {"cidr": "198.51.100.0/24"}, {"domain": "a.test"}]}}"#,
    )
    .expect("valid");
    assert_eq!(p.get("a").expect("a").tls_interception_exemptions.len(), 3);
}

#[test]
fn names() {
    for good in ["a", "sensor", "edge-2", "0", "a-b-c", "-x", "x-"] {
        let text = format!(r#"{{"{good}": {{"allow": [{{"ip": "203.0.113.7"}}]}}}}"#);
        assert!(parse(&text).is_ok(), "{good:?} is a valid name");
    }
    for bad in ["", "Sensor", "a_b", "a.b", "a b", "sénsor", "+a"] {
        let text = format!(r#"{{"{bad}": {{"allow": [{{"ip": "203.0.113.7"}}]}}}}"#);
        assert_eq!(
            parse(&text),
            Err(ProfilesError::InvalidName(bad.into())),
            "{bad:?}"
        );
    }
}

#[test]
fn duplicate_names_fail() {
    let text = r#"{"a": {"allow": [{"ip": "203.0.113.7"}]}, "b": {"allow": [{"ip": "203.0.113.8"}]}, "a": {"allow": [{"ip": "203.0.113.9"}]}}"#;
    let e = parse(text).expect_err("duplicate");
    assert_eq!(e, ProfilesError::DuplicateName("a".into()));
    assert_eq!(
        e.to_string(),
        "SPACE_EGRESS_PROFILES: duplicate profile name \"a\""
    );
}

#[test]
fn allow_must_be_nonempty() {
    for text in [r#"{"a": {"allow": []}}"#, r#"{"a": {"default": true}}"#] {
        let e = parse(text).expect_err(text);
        assert_eq!(e, ProfilesError::EmptyAllow("a".into()));
        assert!(
            e.to_string().contains("profile \"a\": field \"allow\""),
            "{e}"
        );
    }
}

#[test]
fn invalid_json_fails() {
    for text in ["", "{", "{\"a\": }", "not json", "{} x"] {
        assert!(
            matches!(parse(text), Err(ProfilesError::Syntax(_))),
            "{text:?}"
        );
    }
}

#[test]
fn errors_name_profile_and_field() {
    let cases = [
        (r#"{"s": {"allow": [{"ip": "203.0.113.7"}], "ports": [443]}}"#, "profile \"s\": field \"ports\": unknown field `ports`"),
        (r#"{"s": {"allow": [{"ip": "203.0.113.7"}, {"wildcard_domain": "*.a.test"}]}}"#,
         "profile \"s\": field \"allow[1]\": wildcard_domain destinations are not accepted here: expected one of ip, cidr, domain"),
        (r#"{"s": {"allow": [{"ip": "203.0.113.7"}], "tls_interception_exemptions": [{"wildcard_domain": "*.a.test"}]}}"#,
         "profile \"s\": field \"tls_interception_exemptions[0]\": wildcard_domain destinations are not accepted"),
        (r#"{"s": {"allow": [{"domain": "a.test", "port": 443}]}}"#, "profile \"s\": field \"allow[0]\": unsupported selector \"port\""),
        // Profiles take destinations only: no http, no streams.
        (r#"{"s": {"allow": [{"ip": "203.0.113.7", "streams": ["ssh"]}]}}"#, "profile \"s\": field \"allow[0]\": unsupported selector \"streams\""),
        (r#"{"s": {"allow": [{"cidr": "192.0.2.1/24"}]}}"#, "profile \"s\": field \"allow[0]\": cidr \"192.0.2.1/24\" has host bits set"),
        (r#"{"s": {"allow": [{"domain": "bad_name.test"}]}}"#, "profile \"s\": field \"allow[0]\": invalid domain \"bad_name.test\""),
        (r#"{"s": {"default": "yes", "allow": [{"ip": "203.0.113.7"}]}}"#, "profile \"s\": field \"default\": invalid type: string \"yes\", expected a boolean"),
        (r#"{"s": {"allow": [{"ip": "203.0.113.7"}], "allow": [{"ip": "203.0.113.8"}]}}"#, "profile \"s\": duplicate field `allow`"),
        (r#"{"s": []}"#, "profile \"s\": invalid type: sequence, expected an object"),
        (r#"{"s": [false, [{"ip": "203.0.113.7"}]]}"#, "profile \"s\": invalid type: sequence, expected an object"),
        (r#"[]"#, "invalid type: sequence, expected an object"),
    ];
    for (text, needle) in cases {
        let e = parse(text).expect_err(text);
        assert!(matches!(e, ProfilesError::Invalid(_)), "{text}: {e:?}");
        let shown = e.to_string();
        assert!(shown.starts_with("SPACE_EGRESS_PROFILES: "), "{shown}");
        assert!(
            shown.contains(needle),
            "{text}:\n  {shown}\n  lacks {needle:?}"
        );
    }
}
