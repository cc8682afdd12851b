use super::*;

fn profiles() -> Profiles {
    Profiles::from_env_value(Some(
        r#"{"audit": {"default": true, "allow": [{"domain": "audit.example.test"}]},
            "sensor": {"allow": [{"domain": "sensor.example.test"}, {"cidr": "198.51.100.0/24"}],
                       "tls_interception_exemptions": [{"domain": "sensor.example.test"}]}}"#,
    ))
    .expect("valid")
}

fn deployment() -> DeploymentExemptions {
    DeploymentExemptions::from_env_value(Some(
        r#"[{"domain":"relay.example.test"},{"wildcard_domain":"*.relay.example.test"}]"#,
    ))
    .expect("valid")
    .expect("set")
}

fn policy(text: &str) -> Policy {
    Policy::from_json(text).expect(text)
}

fn values<T: ToString>(list: &[T]) -> Vec<String> {
    list.iter().map(ToString::to_string).collect()
}

#[test]
fn profiles_append_allows_exemptions_and_resolvers_without_duplicates() {
    let p = profiles();
    let base = policy(
        r#"{"default": "deny", "allow": [{"domain": "sensor.example.test"}, {"ip": "1.1.1.1"}],
            "deny": [{"cidr": "198.51.100.0/28"}], "tls_interception": "off"}"#,
    );
    let chosen = resolve_saved(&p, &["audit", "sensor"]).expect("configured");
    let c = compose(&base, chosen.iter().map(|(_, prof)| *prof), None);
    assert_eq!(
        values(&c.policy.allow),
        [
            "domain sensor.example.test",
            "ip 1.1.1.1",
            "domain audit.example.test",
            "cidr 198.51.100.0/24",
            "ip 8.8.8.8",
        ]
    );
    assert_eq!(
        values(&c.policy.tls_interception_exemptions),
        ["domain sensor.example.test"]
    );
    assert_eq!(c.policy.deny, base.deny, "denies are never touched");
    assert!(c.changed && c.exemptions_added);

    let again = compose(&c.policy, chosen.iter().map(|(_, prof)| *prof), None);
    assert!(!again.changed, "composition is idempotent");
    assert_eq!(again.policy, c.policy);
}

/// An entry's `streams` are the tenant's: composition keeps them, and a
/// profile's whole-destination allow for the same address is added beside
/// an entry that names streams (allows are a union, like a qualified entry).
#[test]
fn entries_with_streams_are_kept_and_never_stand_for_a_profile_allow() {
    let p = profiles();
    let base = policy(
        r#"{"default": "deny", "allow": [{"cidr": "198.51.100.0/24", "streams": ["ssh"]}, {"ip": "8.8.8.8"}, {"ip": "1.1.1.1"}]}"#,
    );
    let chosen = resolve_saved(&p, &["sensor"]).expect("configured");
    let c = compose(&base, chosen.iter().map(|(_, prof)| *prof), None);
    assert_eq!(
        values(&c.policy.allow),
        [
            "cidr 198.51.100.0/24 streams [ssh]",
            "ip 8.8.8.8",
            "ip 1.1.1.1",
            "domain sensor.example.test",
            "cidr 198.51.100.0/24",
        ]
    );
    let again = compose(&c.policy, chosen.iter().map(|(_, prof)| *prof), None);
    assert!(!again.changed, "composition is idempotent");
    let text = serde_json::to_string(&c.policy).expect("ser");
    assert_eq!(
        Policy::from_json(&text).expect("normal form parses"),
        c.policy
    );
}

#[test]
fn default_allow_gets_no_resolver_allowances_and_no_profiles_adds_nothing() {
    let p = profiles();
    let base = policy(r#"{"default": "allow"}"#);
    let c = compose(&base, p.get("audit"), None);
    assert_eq!(values(&c.policy.allow), ["domain audit.example.test"]);

    let deny = policy(r#"{"default": "deny"}"#);
    let c = compose(&deny, None::<&Profile>, None);
    assert!(!c.changed, "no profiles: no resolver allowances either");
    assert!(c.policy.allow.is_empty());
}

#[test]
fn deployment_exemptions_only_when_interception_is_on() {
    let d = deployment();
    let off = policy(r#"{"tls_interception": "off", "allow": [{"domain": "a.test"}]}"#);
    let c = compose(&off, None::<&Profile>, Some(&d));
    assert!(!c.changed && !c.exemptions_added);

    let on = policy(
        r#"{"tls_interception": "on", "allow": [{"domain": "a.test"}],
            "tls_interception_exemptions": [{"cidr": "203.0.113.0/24"}, {"domain": "relay.example.test"}]}"#,
    );
    let c = compose(&on, None::<&Profile>, Some(&d));
    assert_eq!(
        values(&c.policy.tls_interception_exemptions),
        [
            "cidr 203.0.113.0/24",
            "domain relay.example.test",
            "wildcard_domain *.relay.example.test"
        ],
        "existing kept, duplicate skipped, new appended"
    );
    assert_eq!(c.policy.allow, on.allow, "exemptions never add allows");
    assert!(c.changed && c.exemptions_added);
}

#[test]
fn inherited_template_becomes_override_only_when_something_is_added() {
    let d = deployment();
    let template = policy(
        r#"{"tls_interception": "on",
            "tls_interception_exemptions": [{"domain": "relay.example.test"}, {"wildcard_domain": "*.relay.example.test"}]}"#,
    );
    assert!(!compose(&template, None::<&Profile>, Some(&d)).changed);
    let partial = policy(r#"{"tls_interception": "on"}"#);
    assert!(compose(&partial, None::<&Profile>, Some(&d)).changed);
}

#[test]
fn missing_saved_names_fail_without_defaults() {
    let p = profiles();
    let e = resolve_saved(&p, &["sensor", "gone", "also-gone"]).expect_err("missing");
    assert_eq!(e.missing, "gone");
    assert_eq!(
        e.admissions,
        [
            Admission::unconfigured("gone"),
            Admission::unconfigured("also-gone")
        ]
    );
    let empty: [&str; 0] = [];
    assert!(
        resolve_saved(&p, &empty)
            .expect("empty selection")
            .is_empty(),
        "defaults never added"
    );
}

#[test]
fn the_dns_section_is_the_bases_and_profile_allows_become_resolvable() {
    let p = profiles();
    let base = policy(
        r#"{"default": "deny", "tls_interception": "on",
            "dns": {"resolve": "policy", "query_types": ["A", "AAAA"]}}"#,
    );
    let chosen = resolve_saved(&p, &["sensor"]).expect("configured");
    let c = compose(
        &base,
        chosen.iter().map(|(_, prof)| *prof),
        Some(&deployment()),
    );
    assert_eq!(c.policy.dns, base.dns, "carried over unchanged");
    let compiled = crate::CompiledPolicy::new(
        c.policy,
        std::sync::Arc::new(crate::PlatformDenies::builtin()),
    );
    let name = |n: &str| crate::Hostname::parse(n).expect(n);
    assert_eq!(
        compiled.judge_name(&name("sensor.example.test")),
        crate::NameVerdict::Resolve,
        "the profile's allow is resolvable under resolve: policy"
    );
    // A deployment exemption never allows, so never makes a name resolvable.
    assert_eq!(
        compiled.judge_name(&name("a.relay.example.test")),
        crate::NameVerdict::NoAllowMatch
    );
    // A profile cannot carry a dns section.
    let err = Profiles::from_env_value(Some(
        r#"{"x": {"allow": [{"ip": "192.0.2.1"}], "dns": {"resolve": "any"}}}"#,
    ))
    .expect_err("unknown field");
    assert!(err.to_string().contains("unknown field `dns`"), "{err}");
    // Without a section, composition adds none.
    let plain = compose(&policy(r#"{"default": "deny"}"#), [chosen[0].1], None);
    assert_eq!(plain.policy.dns, None);
}

/// An entry that lapses is not the permanent grant a profile adds: the
/// profile's entry is added beside it.
#[test]
fn a_timed_entry_does_not_stand_for_a_profiles_grant() {
    let mut list = vec![crate::Policy::from_json(
        r#"{"allow": [{"domain": "pypi.test", "until": "2999-01-01T00:00:00Z"}]}"#,
    )
    .expect("policy")
    .allow
    .remove(0)];
    let d = Destination::parse(crate::Kind::Domain, "pypi.test").expect("domain");
    super::push_new_rule(&mut list, &d);
    assert_eq!(list.len(), 2);
    assert_eq!(list[1].until, None);
    super::push_new_rule(&mut list, &d);
    assert_eq!(list.len(), 2, "once");
}
