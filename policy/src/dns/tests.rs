use std::sync::Arc;

use super::*;
use crate::matcher::{CompiledPolicy, NameVerdict, PlatformDenies};
use crate::name::Hostname;
use crate::policy::Policy;

fn policy(text: &str) -> Policy {
    Policy::from_json(text).expect(text)
}

#[test]
fn absent_means_none_and_is_written_without_it() {
    let p = policy(r#"{"default": "deny", "allow": [{"ip": "8.8.8.8"}]}"#);
    assert_eq!(p.dns, None);
    let out = serde_json::to_value(&p).expect("serialises");
    assert!(out.get("dns").is_none(), "{out}");
}

#[test]
fn the_section_reads_and_writes_in_normal_form() {
    let p = policy(
        r#"{"dns": {"resolve": "policy", "query_types": ["A", "TYPE28", "HTTPS", "TYPE65000"]}}"#,
    );
    let dns = p.dns.clone().expect("a dns section");
    assert_eq!(dns.resolve, Resolve::Policy);
    let types: Vec<u16> = dns
        .query_types
        .as_ref()
        .expect("types")
        .iter()
        .map(QueryType::code)
        .collect();
    assert_eq!(types, [1, 28, 65, 65000]);
    let out = serde_json::to_value(&p).expect("serialises");
    assert_eq!(
        out["dns"],
        serde_json::json!({"resolve": "policy", "query_types": ["A", "AAAA", "HTTPS", "TYPE65000"]})
    );
    assert_eq!(Policy::from_json(&out.to_string()).expect("again"), p);
    // An empty section: resolve any, every type but ANY.
    let empty = policy(r#"{"dns": {}}"#).dns.expect("present");
    assert_eq!(empty, DnsPolicy::default());
    assert_eq!(
        serde_json::to_value(&empty).expect("serialises"),
        serde_json::json!({"resolve": "any"})
    );
}

#[test]
fn budget_overrides_read_and_write_back() {
    let p = policy(r#"{"dns": {"budget": {"new_names_per_minute": 60}}}"#);
    let budget = p
        .dns
        .as_ref()
        .and_then(|d| d.budget.clone())
        .expect("a budget");
    assert_eq!(budget.qps, None, "left to the operator's default");
    assert_eq!(budget.new_names_per_minute.map(Rate::get), Some(60));
    let out = serde_json::to_value(&p).expect("serialises");
    assert_eq!(
        out["dns"],
        serde_json::json!({"resolve": "any", "budget": {"new_names_per_minute": 60}})
    );
    assert_eq!(Policy::from_json(&out.to_string()).expect("again"), p);
}

#[test]
fn any_is_refused_whenever_the_section_is_there() {
    let all = DnsPolicy::default();
    assert!(all.permits_type(1) && all.permits_type(16) && all.permits_type(65));
    assert!(!all.permits_type(ANY));
    let some = policy(r#"{"dns": {"query_types": ["A", "AAAA"]}}"#)
        .dns
        .expect("present");
    assert!(some.permits_type(1) && some.permits_type(28));
    assert!(!some.permits_type(16), "TXT is not listed");
    assert!(!some.permits_type(ANY));
}

#[test]
fn errors_name_the_field_and_the_value() {
    let cases = [
        (
            r#"{"dns": {"resolve": "all"}}"#,
            "dns.resolve",
            "unknown variant `all`",
        ),
        (
            r#"{"dns": {"reslove": "any"}}"#,
            "dns.reslove",
            "unknown field `reslove`",
        ),
        (
            r#"{"dns": {"query_types": ["A", "ANY"]}}"#,
            "dns.query_types[1]",
            "\"ANY\" (ANY) is always refused (RFC 8482)",
        ),
        (
            r#"{"dns": {"query_types": ["TYPE255"]}}"#,
            "dns.query_types[0]",
            "\"TYPE255\" (ANY)",
        ),
        (
            r#"{"dns": {"query_types": ["aaaa"]}}"#,
            "dns.query_types[0]",
            "unknown query type \"aaaa\"",
        ),
        (
            r#"{"dns": {"query_types": ["TYPE070000"]}}"#,
            "dns.query_types[0]",
            "unknown query type \"TYPE070000\"",
        ),
        (
            r#"{"dns": {"query_types": ["AXFR"]}}"#,
            "dns.query_types[0]",
            "unknown query type \"AXFR\"",
        ),
        (
            r#"{"dns": {"query_types": ["TYPE252"]}}"#,
            "dns.query_types[0]",
            "meta or question-only",
        ),
        (
            r#"{"dns": {"query_types": ["TYPE41"]}}"#,
            "dns.query_types[0]",
            "meta or question-only",
        ),
        (
            r#"{"dns": {"query_types": ["A", "TYPE1"]}}"#,
            "dns.query_types",
            "\"A\" is listed twice",
        ),
        (
            r#"{"dns": {"query_types": []}}"#,
            "dns.query_types",
            "omit query_types",
        ),
        (r#"{"dns": ["policy"]}"#, "dns", "expected an object"),
        (
            r#"{"dns": {"resolve": "any", "resolve": "policy"}}"#,
            "dns",
            "duplicate field `resolve`",
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
    // Every query is checked against the list: a long one is refused
    // (each type listed once, so only the length is at fault).
    let types: Vec<String> = (1000..1000 + MAX_QUERY_TYPES as u32 + 1)
        .map(|n| format!("TYPE{n}"))
        .collect();
    let text = serde_json::json!({"dns": {"query_types": types}}).to_string();
    let err = Policy::from_json(&text).expect_err("65 types");
    assert_eq!(err.path.trim_start_matches('.'), "dns.query_types", "{err}");
    assert!(err.message.contains("at most 64"), "{err}");
    let fits = serde_json::json!({"dns": {"query_types": &types[..MAX_QUERY_TYPES]}}).to_string();
    Policy::from_json(&fits).expect("64 types");
}

fn judge(text: &str, name: &str) -> NameVerdict {
    let compiled = CompiledPolicy::new(policy(text), Arc::new(PlatformDenies::builtin()));
    compiled.judge_name(&Hostname::parse(name).expect(name))
}

#[test]
fn resolve_policy_judges_names_with_the_flow_lists() {
    let deny_default = r#"{"default": "deny",
        "allow": [{"domain": "api.example.test"}, {"wildcard_domain": "*.cdn.test"},
                  {"domain": "gh.test", "http": "read_only"}, {"ip": "8.8.8.8"}, {"cidr": "192.0.2.0/24"}],
        "deny": [{"domain": "bad.cdn.test"}, {"domain": "api.example.test", "http": {"paths": ["/admin"]}}],
        "dns": {"resolve": "policy"}}"#;
    let cases = [
        ("api.example.test", NameVerdict::Resolve),
        ("a.cdn.test", NameVerdict::Resolve),
        ("gh.test", NameVerdict::Resolve), // a qualified allow still allows the name
        ("bad.cdn.test", NameVerdict::TenantDeny),
        ("cdn.test", NameVerdict::NoAllowMatch), // a wildcard never covers its apex
        ("x.api.example.test", NameVerdict::NoAllowMatch),
        ("exfil-abc123.attacker.test", NameVerdict::NoAllowMatch),
    ];
    for (name, want) in cases {
        assert_eq!(judge(deny_default, name), want, "{name}");
    }
    let allow_default = r#"{"default": "allow", "deny": [{"wildcard_domain": "*.attacker.test"}]}"#;
    assert_eq!(judge(allow_default, "anything.test"), NameVerdict::Resolve);
    assert_eq!(
        judge(allow_default, "x.attacker.test"),
        NameVerdict::TenantDeny
    );
    assert_eq!(judge(allow_default, "attacker.test"), NameVerdict::Resolve);
    assert_eq!(NameVerdict::NoAllowMatch.code(), "no_allow_match");
}

#[test]
fn platform_name_denies_come_first() {
    let platform = PlatformDenies::new(vec![crate::Destination::parse(
        crate::Kind::Domain,
        "metadata.internal.test",
    )
    .expect("valid")]);
    let compiled = CompiledPolicy::new(
        policy(r#"{"default": "allow", "allow": [{"domain": "metadata.internal.test"}]}"#),
        Arc::new(platform),
    );
    assert_eq!(
        compiled.judge_name(&Hostname::parse("metadata.internal.test").expect("name")),
        NameVerdict::PlatformDeny
    );
}
