use super::*;
use crate::compose::compose;
use crate::policy::Policy;
use crate::profiles::Profiles;

fn policy(text: &str) -> Policy {
    Policy::from_json(text).expect(text)
}

fn name(s: &str) -> Hostname {
    Hostname::parse(s).expect(s)
}

#[test]
fn absent_means_none_and_is_written_without_them() {
    let p = policy(r#"{"allow": [{"domain": "api.example.test"}]}"#);
    assert!(p.budgets.is_empty());
    let out = serde_json::to_value(&p).expect("serialises");
    assert!(out.get("budgets").is_none(), "{out}");
    assert!(policy(r#"{"budgets": []}"#).budgets.is_empty());
}

#[test]
fn entries_read_and_write_back_in_normal_form() {
    let p = policy(
        r#"{"budgets": [
            {"destination": "API.Example.test.", "requests_per_minute": 60},
            {"destination": "*.example.test", "bytes_per_hour": 1048576},
            {"destination": "*", "requests_per_minute": 1000000, "bytes_per_hour": 1099511627776}
        ]}"#,
    );
    assert_eq!(p.budgets.len(), 3);
    let out = serde_json::to_value(&p).expect("serialises");
    assert_eq!(
        out["budgets"],
        serde_json::json!([
            {"destination": "api.example.test", "requests_per_minute": 60},
            {"destination": "*.example.test", "bytes_per_hour": 1048576},
            {"destination": "*", "requests_per_minute": 1000000, "bytes_per_hour": 1099511627776u64}
        ])
    );
    assert_eq!(Policy::from_json(&out.to_string()).expect("again"), p);
}

#[test]
fn errors_name_the_field_and_the_value() {
    let cases = [
        (
            r#"{"budgets": [{"destination": "*", "requests_per_minute": 1}, {"destination": "a.test"}]}"#,
            "budgets[1]",
            "budget for a.test sets no limit",
        ),
        (
            r#"{"budgets": [{"destination": "a.test", "requests_per_minute": 0}]}"#,
            "budgets[0]",
            "requests_per_minute 0 is outside 1..=1000000",
        ),
        (
            r#"{"budgets": [{"destination": "a.test", "requests_per_minute": 1000001}]}"#,
            "budgets[0]",
            "requests_per_minute 1000001 is outside",
        ),
        (
            r#"{"budgets": [{"destination": "a.test", "bytes_per_hour": 1023}]}"#,
            "budgets[0]",
            "bytes_per_hour 1023 is outside 1024..=1099511627776",
        ),
        (
            r#"{"budgets": [{"destination": "a.test", "bytes_per_hour": 1099511627777}]}"#,
            "budgets[0]",
            "bytes_per_hour 1099511627777 is outside",
        ),
        (
            r#"{"budgets": [{"destination": "a.test", "requests_per_minute": -1}]}"#,
            "budgets[0].requests_per_minute",
            "invalid value: integer `-1`",
        ),
        (
            r#"{"budgets": [{"destination": "bad_name.test", "requests_per_minute": 1}]}"#,
            "budgets[0].destination",
            "invalid budget destination \"bad_name.test\"",
        ),
        (
            r#"{"budgets": [{"destination": "*.*.test", "requests_per_minute": 1}]}"#,
            "budgets[0].destination",
            "invalid budget destination \"*.*.test\"",
        ),
        (
            r#"{"budgets": [{"destination": "10.0.0.1", "requests_per_minute": 1}]}"#,
            "budgets[0].destination",
            "an IP literal is not a hostname",
        ),
        (
            r#"{"budgets": [{"destination": "a.test", "requests_per_minute": 1, "per": "minute"}]}"#,
            "budgets[0].per",
            "unknown field `per`",
        ),
        (
            r#"{"budgets": [["a.test", 1]]}"#,
            "budgets[0]",
            "expected an object",
        ),
        (
            r#"{"budgets": {"destination": "*"}}"#,
            "budgets",
            "expected a sequence",
        ),
    ];
    for (text, path, needle) in cases {
        let err = Policy::from_json(text).expect_err(text);
        assert_eq!(err.path.trim_start_matches('.'), path, "{text}: {err}");
        assert!(
            err.message.contains(needle),
            "{text}: {err} lacks {needle:?}"
        );
    }
}

#[test]
fn the_list_is_bounded() {
    let entry = r#"{"destination": "*", "requests_per_minute": 1}"#;
    let list = |n: usize| format!(r#"{{"budgets": [{}]}}"#, vec![entry; n].join(","));
    assert_eq!(policy(&list(MAX_BUDGETS)).budgets.len(), MAX_BUDGETS);
    let err = Policy::from_json(&list(MAX_BUDGETS + 1)).expect_err("65 entries");
    assert_eq!(err.path, "budgets");
    assert!(err.message.contains("65 budgets: at most 64"), "{err}");
}

#[test]
fn the_first_matching_entry_applies_as_domain_rules_match() {
    let p = policy(
        r#"{"budgets": [
            {"destination": "api.example.test", "requests_per_minute": 1},
            {"destination": "*.example.test", "requests_per_minute": 2},
            {"destination": "*", "requests_per_minute": 3}
        ]}"#,
    );
    let b = &p.budgets;
    let rule = |names: &[Hostname]| b.find(names).map(|(i, _)| i);
    assert_eq!(rule(&[name("api.example.test")]), Some(0));
    assert_eq!(rule(&[name("x.api.example.test")]), Some(1));
    // A wildcard never matches its apex: `*` takes it.
    assert_eq!(rule(&[name("example.test")]), Some(2));
    assert_eq!(rule(&[name("other.test")]), Some(2));
    assert_eq!(rule(&[]), Some(2), "`*` covers a flow without names");
    // Any of a flow's names may select an entry; the first entry wins.
    assert_eq!(
        rule(&[name("other.test"), name("api.example.test")]),
        Some(0)
    );
    // Charged: the first entry any name covers, and the evidence's too when
    // a claim chose the first.
    let charged = |evidence: &[Hostname], claims: &[Hostname]| {
        let e: Vec<&Hostname> = evidence.iter().collect();
        let c: Vec<&Hostname> = claims.iter().collect();
        b.charged(&e, &c)
            .iter()
            .map(|(i, _)| *i)
            .collect::<Vec<_>>()
    };
    assert_eq!(charged(&[name("api.example.test")], &[]), [0]);
    assert_eq!(
        charged(&[name("other.test")], &[name("api.example.test")]),
        [0, 2]
    );
    assert_eq!(charged(&[], &[name("x.example.test")]), [1, 2]);
    assert_eq!(
        charged(&[name("x.example.test")], &[name("x.example.test")]),
        [1]
    );
    let only_names =
        policy(r#"{"budgets": [{"destination": "*.example.test", "bytes_per_hour": 2048}]}"#);
    let e: Vec<&Hostname> = Vec::new();
    let claim = name("x.example.test");
    assert_eq!(
        only_names.budgets.charged(&e, &[&claim]).len(),
        1,
        "a claim alone may add one"
    );
    assert_eq!(only_names.budgets.find(&[]), None);
    assert!(only_names.budgets.limits_bytes());
    assert!(!p.budgets.limits_bytes());
    // Order decides, not specificity.
    let wide_first = policy(
        r#"{"budgets": [{"destination": "*", "requests_per_minute": 3},
                        {"destination": "api.example.test", "requests_per_minute": 1}]}"#,
    );
    assert_eq!(
        wide_first
            .budgets
            .find(&[name("api.example.test")])
            .map(|(i, _)| i),
        Some(0)
    );
}

#[test]
fn composition_keeps_the_tenants_budgets_and_profiles_cannot_carry_any() {
    let base = policy(
        r#"{"default": "deny", "tls_interception": "on",
            "budgets": [{"destination": "*", "requests_per_minute": 10}]}"#,
    );
    let profiles = Profiles::from_env_value(Some(
        r#"{"sensor": {"allow": [{"domain": "sensor.example.test"}]}}"#,
    ))
    .expect("valid");
    let composed = compose(&base, profiles.get("sensor"), None);
    assert!(composed.changed);
    assert_eq!(
        composed.policy.budgets, base.budgets,
        "no profile removes a budget"
    );
    let err = Profiles::from_env_value(Some(
        r#"{"sensor": {"allow": [{"domain": "s.test"}], "budgets": [{"destination": "*", "requests_per_minute": 1}]}}"#,
    ))
    .expect_err("a profile carries no budgets");
    assert!(err.to_string().contains("unknown field `budgets`"), "{err}");
}
