use std::net::Ipv4Addr;

use proptest::prelude::*;
use serde_json::{json, Value};

use super::*;

fn parse(v: &Value) -> MachineEgress {
    MachineEgress::from_value(v).unwrap_or_else(|p| panic!("{v} should be valid: {p:?}"))
}

fn problems(v: &Value) -> Vec<Problem> {
    let p = MachineEgress::from_value(v).expect_err(&format!("{v} should be invalid"));
    assert!(!p.is_empty());
    p
}

/// The only problem of an invalid document.
fn problem(v: &Value) -> Problem {
    let mut p = problems(v);
    assert_eq!(p.len(), 1, "{v}: {p:?}");
    p.remove(0)
}

/// The only problem of a document with the one rule `r`, which must be rule 0's.
fn rule_problem(r: Value) -> String {
    let p = problem(&json!({"rules": [r]}));
    assert_eq!(p.rule, Some(0), "{p:?}");
    p.message
}

fn net(s: &str) -> Ipv4Net {
    s.parse().expect("test network")
}

fn ip(s: &str) -> Ipv4Addr {
    s.parse().expect("test address")
}

fn rule(cidr: &str, entry: Entry) -> Rule {
    Rule::new(net(cidr), entry, None)
}

fn allowlist(rules: Vec<Rule>) -> MachineEgress {
    MachineEgress {
        mode: Mode::Allowlist,
        rules,
    }
}

const TCP: Proto = Proto::Tcp;
const UDP: Proto = Proto::Udp;

// --- modes ---

#[test]
fn each_mode_parses() {
    let r = json!({"cidr": "10.0.0.0/8"});
    let cases = [
        (json!({"mode": "loopback"}), Mode::Loopback, 0),
        (json!({"mode": "loopback", "rules": []}), Mode::Loopback, 0),
        (json!({"mode": "open"}), Mode::Open, 0),
        (json!({"mode": "audit"}), Mode::Audit, 0),
        (json!({"mode": "audit", "rules": [r]}), Mode::Audit, 1),
        (
            json!({"mode": "allowlist", "rules": [r, r]}),
            Mode::Allowlist,
            2,
        ),
        (json!({"mode": "allowlist"}), Mode::Allowlist, 0),
    ];
    for (doc, mode, rules) in cases {
        let p = parse(&doc);
        assert_eq!((p.mode, p.rules.len()), (mode, rules), "{doc}");
    }
}

#[test]
fn absent_mode_is_loopback_without_rules_and_allowlist_with_them() {
    assert_eq!(parse(&json!({})), MachineEgress::loopback());
    assert_eq!(parse(&json!({"rules": []})), MachineEgress::loopback());
    let p = parse(&json!({"rules": [{"cidr": "10.0.0.0/8", "proto": "tcp", "port": 5151}]}));
    assert_eq!(p.mode, Mode::Allowlist);
    assert_eq!(p.rules, [rule("10.0.0.0/8", Entry::Port(TCP, 5151))]);
}

#[test]
fn rules_under_loopback_or_open_are_refused() {
    for mode in ["loopback", "open"] {
        let p = problem(
            &json!({"mode": mode, "rules": [{"cidr": "10.0.0.0/8"}, {"cidr": "0.0.0.0/0"}]}),
        );
        assert_eq!(p.rule, None);
        assert!(p.message.contains(&format!("mode {mode}")), "{}", p.message);
        assert!(
            p.message.contains("2 rules would be ignored"),
            "{}",
            p.message
        );
    }
}

#[test]
fn mode_must_be_a_known_string() {
    let cases = [
        (json!({"mode": "Allowlist"}), "\"Allowlist\""),
        (json!({"mode": "deny"}), "\"deny\""),
        (json!({"mode": 1}), "a number (1)"),
        (json!({"mode": null}), "found null"),
        (json!({"mode": ["open"]}), "an array"),
        // A refused mode with rules is one problem, not also "rules ignored".
        (
            json!({"mode": "closed", "rules": [{"cidr": "10.0.0.0/8"}]}),
            "\"closed\"",
        ),
    ];
    for (doc, needle) in cases {
        let p = problem(&doc);
        assert_eq!(p.rule, None);
        assert!(p.message.contains("mode"), "{}", p.message);
        assert!(p.message.contains(needle), "{needle}: {}", p.message);
    }
}

#[test]
fn rules_must_be_an_array() {
    for (rules, found) in [
        (json!({}), "an object"),
        (json!("10.0.0.0/8"), "a string (\"10.0.0.0/8\")"),
        (json!(null), "null"),
    ] {
        let p = problem(&json!({"mode": "allowlist", "rules": rules}));
        assert_eq!(p.rule, None);
        assert!(p.message.starts_with("rules:"), "{}", p.message);
        assert!(p.message.contains(found), "{}", p.message);
    }
}

#[test]
fn unknown_top_level_fields_are_named() {
    let p = problems(&json!({"mode": "open", "rule": [], "ports": 1}));
    assert_eq!(p.len(), 2, "{p:?}");
    assert!(p.iter().all(|p| p.rule.is_none()));
    assert!(p[0].message.contains("\"ports\"") || p[1].message.contains("\"ports\""));
    assert!(p
        .iter()
        .any(|p| p.message.contains("unknown field \"rule\"")));
}

#[test]
fn repeated_fields_are_refused_in_text() {
    let p =
        MachineEgress::from_json(r#"{"mode": "open", "mode": "loopback"}"#).expect_err("repeated");
    assert_eq!(
        p,
        [Problem {
            rule: None,
            message: "repeated field \"mode\"".into()
        }]
    );
    let p = MachineEgress::from_json(
        r#"{"rules": [{"cidr": "10.0.0.0/8"}, {"cidr": "10.0.0.0/8", "cidr": "0.0.0.0/0"}]}"#,
    )
    .expect_err("repeated");
    assert_eq!(
        p,
        [Problem {
            rule: Some(1),
            message: "repeated field \"cidr\"".into()
        }]
    );
}

#[test]
fn input_must_be_a_json_object() {
    for doc in [
        json!([]),
        json!("allowlist"),
        json!(5),
        json!(null),
        json!(true),
    ] {
        let p = problem(&doc);
        assert_eq!(p.rule, None);
        assert!(
            p.message.starts_with("policy must be a JSON object"),
            "{}",
            p.message
        );
    }
    let p = MachineEgress::from_json(r#"[{"mode": "open"}]"#).expect_err("array");
    assert_eq!(p.len(), 1);
    assert!(p[0].message.contains("an array"), "{}", p[0].message);
}

#[test]
fn text_that_is_not_json_is_one_problem() {
    for text in [
        "",
        "{mode: open}",
        r#"{"mode": "open"} x"#,
        r#"{"mode": "open""#,
        "nope",
    ] {
        let p = MachineEgress::from_json(text).expect_err(text);
        assert_eq!(p.len(), 1, "{text}: {p:?}");
        assert_eq!(p[0].rule, None);
        assert!(
            p[0].message.starts_with("not valid JSON"),
            "{}",
            p[0].message
        );
    }
}

// --- rules ---

#[test]
fn a_bare_address_is_a_slash_32() {
    let p = parse(
        &json!({"rules": [{"cidr": "10.1.2.3"}, {"cidr": "0.0.0.0/0"}, {"cidr": "10.1.2.3/32"}]}),
    );
    assert_eq!(p.rules[0].net, net("10.1.2.3/32"));
    assert_eq!(p.rules[0], p.rules[2]);
    assert_eq!(p.rules[1].net, Ipv4Net::default());
    assert_eq!(p.to_value()["rules"][0]["cidr"], "10.1.2.3/32");
}

#[test]
fn host_bits_name_the_canonical_form() {
    for (cidr, canonical) in [
        ("10.1.2.3/8", "\"10.0.0.0/8\""),
        ("192.168.1.1/24", "\"192.168.1.0/24\""),
        ("1.2.3.4/0", "\"0.0.0.0/0\""),
    ] {
        let m = rule_problem(json!({"cidr": cidr}));
        assert!(m.contains("host bits"), "{m}");
        assert!(m.contains(canonical), "{canonical}: {m}");
        assert!(m.contains(&format!("{cidr:?}")), "{m}");
    }
}

#[test]
fn ipv6_is_not_supported() {
    for cidr in [
        "::ffff:1.2.3.4",
        "::ffff:1.2.3.4/128",
        "2001:db8::/32",
        "::1",
        "::/0",
    ] {
        let m = rule_problem(json!({"cidr": cidr}));
        assert!(m.contains("IPv6 is not supported"), "{m}");
        assert!(m.contains(&format!("{cidr:?}")), "{m}");
    }
}

#[test]
fn malformed_cidrs_name_the_value() {
    // What std refuses is refused here, leading zeros included.
    assert!("010.0.0.0".parse::<Ipv4Addr>().is_err());
    for cidr in [
        "010.0.0.0/8",
        "10.0.0.01",
        "10.0.0/8",
        "10.0.0.0/33",
        "10.0.0.0/",
        "10.0.0.0/+8",
        "10.0.0.0/08",
        "10.0.0.0/-1",
        "10.0.0.0/8/8",
        "",
        " 10.0.0.0/8",
        "1.2.3.4:80",
        "example.com",
        "256.0.0.0/8",
    ] {
        let m = rule_problem(json!({"cidr": cidr}));
        assert!(m.contains(&format!("{cidr:?}")), "{m}");
    }
    let m = rule_problem(json!({"cidr": 167772160}));
    assert!(m.contains("cidr") && m.contains("a number"), "{m}");
    let m = rule_problem(json!({"proto": "tcp"}));
    assert!(m.contains("cidr is required"), "{m}");
}

#[test]
fn proto_must_be_tcp_or_udp() {
    for (proto, needle) in [
        (json!("TCP"), "\"TCP\""),
        (json!("icmp"), "\"icmp\""),
        (json!(6), "a number (6)"),
    ] {
        let m = rule_problem(json!({"cidr": "10.0.0.0/8", "proto": proto}));
        assert!(m.contains("proto") && m.contains(needle), "{m}");
    }
    let p = parse(&json!({"rules": [{"cidr": "10.0.0.0/8", "proto": "udp"}]}));
    assert_eq!(p.rules[0].entry(), Entry::Proto(UDP));
}

#[test]
fn ports_are_integers_from_1_to_65535_with_a_proto() {
    for port in [1, 65535] {
        let p = parse(&json!({"rules": [{"cidr": "10.0.0.0/8", "proto": "tcp", "port": port}]}));
        assert_eq!(p.rules[0].port, Some(u16::try_from(port).expect("u16")));
    }
    for (port, needle) in [
        (json!(0), "port 0:"),
        (json!(65536), "port 65536:"),
        (json!(-1), "port -1:"),
        (json!(80.5), "port 80.5:"),
        (json!(80.0), "port 80.0:"),
        (json!("80"), "a string (\"80\")"),
        (json!(null), "null"),
    ] {
        let m = rule_problem(json!({"cidr": "10.0.0.0/8", "proto": "tcp", "port": port}));
        assert!(m.contains(needle), "{needle}: {m}");
        assert!(m.contains("1 to 65535"), "{m}");
    }
    let m = rule_problem(json!({"cidr": "10.0.0.0/8", "port": 443}));
    assert!(m.contains("port 443 needs a proto"), "{m}");
    // A refused proto is the problem; the port is not also "without proto".
    let m = rule_problem(json!({"cidr": "10.0.0.0/8", "proto": "sctp", "port": 443}));
    assert!(m.contains("\"sctp\""), "{m}");
    // Both wrong: both said.
    let p = problems(&json!({"rules": [{"cidr": "10.0.0.0/8", "port": 0}]}));
    assert_eq!(p.len(), 2, "{p:?}");
}

#[test]
fn notes_are_short_and_printable() {
    let long_ok = "é".repeat(MAX_NOTE_CHARS);
    let p = parse(&json!({"rules": [{"cidr": "10.0.0.0/8", "note": long_ok}]}));
    assert_eq!(p.rules[0].note.as_deref(), Some(long_ok.as_str()));

    let m = rule_problem(json!({"cidr": "10.0.0.0/8", "note": "a".repeat(MAX_NOTE_CHARS + 1)}));
    assert!(m.contains("257 characters") && m.contains("256"), "{m}");
    for (note, code) in [
        ("a\nb", "U+000A"),
        ("tab\there", "U+0009"),
        ("\u{7f}", "U+007F"),
        ("x\u{85}", "U+0085"),
    ] {
        let m = rule_problem(json!({"cidr": "10.0.0.0/8", "note": note}));
        assert!(m.contains(code) && m.contains("printable"), "{m}");
    }
    let m = rule_problem(json!({"cidr": "10.0.0.0/8", "note": 5}));
    assert!(m.contains("note") && m.contains("a number (5)"), "{m}");
}

#[test]
fn unknown_rule_fields_and_non_objects_are_named_with_their_rule() {
    let p = problems(
        &json!({"rules": [{"cidr": "10.0.0.0/8"}, {"cidr": "10.0.0.0/8", "ports": [80]}]}),
    );
    assert_eq!(p.len(), 1);
    assert_eq!(p[0].rule, Some(1));
    assert!(
        p[0].message.contains("unknown field \"ports\""),
        "{}",
        p[0].message
    );

    let p = problem(&json!({"rules": ["10.0.0.0/8"]}));
    assert_eq!(p.rule, Some(0));
    assert!(
        p.message.contains("a string (\"10.0.0.0/8\")"),
        "{}",
        p.message
    );
}

#[test]
fn repeated_identical_rules_are_allowed() {
    let r = json!({"cidr": "10.0.0.0/8", "proto": "tcp", "port": 443, "note": "x"});
    let p = parse(&json!({"rules": [r, r, r]}));
    assert_eq!(p.rules.len(), 3);
    assert!(p.rules.iter().all(|x| *x == p.rules[0]));
}

#[test]
fn at_most_256_rules() {
    let r = json!({"cidr": "10.0.0.0/8", "proto": "tcp", "port": 443});
    let p = parse(&json!({"rules": vec![r.clone(); MAX_RULES]}));
    assert_eq!(p.rules.len(), MAX_RULES);

    let p = problem(&json!({"rules": vec![r; MAX_RULES + 1]}));
    assert_eq!(p.rule, None);
    assert!(
        p.message.contains("257 rules") && p.message.contains("256"),
        "{}",
        p.message
    );

    // The count is said once however many rules there are; bad rules too.
    let mut many = vec![json!({"cidr": "10.0.0.0/8"}); 1000];
    many[999] = json!({"cidr": "10.0.0.1/8"});
    let p = problems(&json!({"rules": many}));
    assert_eq!(p.len(), 2, "{p:?}");
    assert_eq!((p[0].rule, p[1].rule), (None, Some(999)));
}

#[test]
fn every_problem_is_collected_with_its_rule() {
    let doc = json!({
        "mode": "allowlist",
        "extra": true,
        "rules": [
            {"cidr": "10.0.0.0/8", "proto": "tcp", "port": 5151, "note": "Veyron API"},
            {"cidr": "10.1.2.3/8"},
            {"cidr": "91.189.88.0/21", "port": 80, "colour": "red"},
            {"cidr": "::ffff:1.2.3.4", "proto": "tcp", "port": 0},
            {"cidr": "0.0.0.0/0", "proto": "udp", "port": 53},
        ]
    });
    let p = problems(&doc);
    let got: Vec<(Option<usize>, &str)> = p.iter().map(|p| (p.rule, p.message.as_str())).collect();
    let want: &[(Option<usize>, &str)] = &[
        (None, "unknown field \"extra\""),
        (Some(1), "\"10.0.0.0/8\""),
        (Some(2), "unknown field \"colour\""),
        (Some(2), "port 80 needs a proto"),
        (Some(3), "IPv6"),
        (Some(3), "port 0:"),
    ];
    assert_eq!(got.len(), want.len(), "{got:#?}");
    for ((rule, msg), (want_rule, needle)) in got.iter().zip(want) {
        assert_eq!(rule, want_rule, "{msg}");
        assert!(msg.contains(needle), "{needle}: {msg}");
    }
}

// --- entries per network ---

fn port_rule(cidr: &str, proto: &str, port: u16) -> Value {
    json!({"cidr": cidr, "proto": proto, "port": port})
}

#[test]
fn entries_count_those_of_every_covering_network() {
    let doc = json!({"rules": [
        port_rule("0.0.0.0/0", "udp", 53),
        {"cidr": "10.0.0.0/8", "proto": "tcp"},
        port_rule("10.1.0.0/16", "tcp", 443),
        port_rule("10.1.2.0/24", "tcp", 80),
        {"cidr": "10.1.2.0/24"},
        port_rule("10.1.2.0/24", "tcp", 80),
    ]});
    // The /16 carries 3 entries; the /24 five, said once at its first rule.
    let p = problem(&doc);
    assert_eq!(p.rule, Some(3));
    for needle in [
        "network 10.1.2.0/24",
        "5 distinct entries",
        "at most 4",
        "udp/53 (rule 0)",
        "tcp/any (rule 1)",
        "tcp/443 (rule 2)",
        "tcp/80 (rules 3, 5)",
        "any (rule 4)",
    ] {
        assert!(p.message.contains(needle), "{needle}: {}", p.message);
    }
    // Without the `any` on the /24 it fits.
    let mut rules = doc["rules"].as_array().expect("rules").clone();
    rules.remove(4);
    parse(&json!({ "rules": rules }));
}

#[test]
fn sibling_networks_do_not_count_against_each_other() {
    let mut rules = Vec::new();
    for (cidr, proto) in [
        ("10.1.2.0/24", "tcp"),
        ("10.1.3.0/24", "udp"),
        ("10.1.2.128/25", "udp"),
    ] {
        for port in 1..=4 {
            rules.push(port_rule(cidr, proto, port));
        }
    }
    // 10.1.2.128/25 is inside 10.1.2.0/24: 8 entries.
    let p = problem(&json!({ "rules": rules }));
    assert_eq!(p.rule, Some(8));
    assert!(p.message.contains("10.1.2.128/25"), "{}", p.message);
    rules.truncate(8);
    parse(&json!({ "rules": rules }));
}

#[test]
fn identical_entries_count_once_and_proto_any_is_not_a_port() {
    let ok = json!({"rules": [
        port_rule("0.0.0.0/0", "tcp", 80),
        port_rule("10.0.0.0/8", "tcp", 80),
        port_rule("10.1.0.0/16", "tcp", 80),
        port_rule("10.1.2.0/24", "tcp", 443),
        port_rule("10.1.2.0/24", "udp", 53),
        {"cidr": "10.1.2.0/24"},
    ]});
    parse(&ok);
    let over = json!({"rules": [
        {"cidr": "10.0.0.0/8", "proto": "tcp"},
        port_rule("10.0.0.0/8", "tcp", 443),
        {"cidr": "10.0.0.0/8", "proto": "udp"},
        port_rule("10.0.0.0/8", "udp", 53),
        {"cidr": "10.0.0.0/8"},
    ]});
    let p = problem(&over);
    assert_eq!(p.rule, Some(0));
    assert!(
        p.message.contains("tcp/any (rule 0), tcp/443 (rule 1)"),
        "{}",
        p.message
    );
}

#[test]
fn each_overflowing_network_is_reported_once() {
    let mut rules = Vec::new();
    for cidr in ["192.168.1.0/24", "192.168.2.0/24"] {
        for port in 1..=5 {
            rules.push(port_rule(cidr, "tcp", port));
        }
    }
    let p = problems(&json!({ "rules": rules }));
    let at: Vec<Option<usize>> = p.iter().map(|p| p.rule).collect();
    assert_eq!(at, [Some(0), Some(5)]);
}

// --- normal form ---

#[test]
fn normal_form_round_trips() {
    let doc = json!({"rules": [
        {"cidr": "10.0.0.0/8", "proto": "tcp", "port": 5151, "note": "Veyron API"},
        {"cidr": "91.189.88.0/21", "proto": "tcp", "port": 80},
        {"note": "DNS", "port": 53, "proto": "udp", "cidr": "0.0.0.0/0"},
        {"cidr": "192.0.2.1", "proto": "udp"},
        {"cidr": "192.0.2.1"},
    ]});
    let p = parse(&doc);
    let normal = p.to_value();
    assert_eq!(
        normal,
        json!({"mode": "allowlist", "rules": [
            {"cidr": "10.0.0.0/8", "proto": "tcp", "port": 5151, "note": "Veyron API"},
            {"cidr": "91.189.88.0/21", "proto": "tcp", "port": 80},
            {"cidr": "0.0.0.0/0", "proto": "udp", "port": 53, "note": "DNS"},
            {"cidr": "192.0.2.1/32", "proto": "udp"},
            {"cidr": "192.0.2.1/32"},
        ]})
    );
    let again = parse(&normal);
    assert_eq!(again, p);
    assert_eq!(again.to_value(), normal);
    assert_eq!(
        parse(&json!({})).to_value(),
        json!({"mode": "loopback", "rules": []})
    );
    assert_eq!(
        parse(&json!({"mode": "audit"})).to_value(),
        json!({"mode": "audit", "rules": []})
    );
}

#[test]
fn serde_reads_with_validation_and_writes_the_normal_form() {
    let p = parse(&json!({"rules": [{"cidr": "192.0.2.1", "proto": "tcp", "port": 22}]}));
    let text = serde_json::to_string(&p).expect("serialize");
    assert_eq!(
        serde_json::from_str::<Value>(&text).expect("json"),
        p.to_value()
    );
    assert_eq!(
        serde_json::from_str::<MachineEgress>(&text).expect("deserialize"),
        p
    );

    let e = serde_json::from_str::<MachineEgress>(r#"{"rules": [{"cidr": "10.0.0.1/8"}], "x": 1}"#)
        .expect_err("invalid")
        .to_string();
    let want = "unknown field \"x\": expected mode or rules; \
                rules[0]: cidr \"10.0.0.1/8\" has host bits";
    assert!(e.contains(want), "{e}");
    let e = serde_json::from_str::<MachineEgress>(r#"{"mode": "open", "mode": "open"}"#)
        .expect_err("repeated");
    assert!(e.to_string().contains("repeated field"), "{e}");
}

#[test]
fn validate_checks_a_policy_built_in_code() {
    assert_eq!(
        allowlist(vec![rule("10.0.0.0/8", Entry::Any)]).validate(),
        Ok(())
    );
    let bad = Rule {
        net: net("10.0.0.0/8"),
        proto: None,
        port: Some(80),
        note: None,
    };
    let p = allowlist(vec![bad])
        .validate()
        .expect_err("port without proto");
    assert_eq!(p[0].rule, Some(0));
    let open_with_rules = MachineEgress {
        mode: Mode::Open,
        rules: vec![rule("10.0.0.0/8", Entry::Any)],
    };
    assert!(open_with_rules.validate().is_err());
}

// --- names and display ---

#[test]
fn names_display_and_parse() {
    assert_eq!(
        [Entry::Any, Entry::Proto(TCP), Entry::Port(UDP, 53)].map(|e| e.to_string()),
        ["any", "tcp/any", "udp/53"]
    );
    assert_eq!(
        Mode::ALL.map(Mode::as_str),
        ["loopback", "allowlist", "audit", "open"]
    );
    for m in Mode::ALL {
        assert_eq!(m.as_str().parse::<Mode>(), Ok(m));
        assert_eq!(serde_json::to_value(m).expect("mode"), json!(m.as_str()));
        assert_eq!(
            serde_json::from_value::<Mode>(json!(m.as_str())).expect("mode"),
            m
        );
    }
    for p in Proto::ALL {
        assert_eq!(p.to_string().parse::<Proto>(), Ok(p));
        assert_eq!(serde_json::to_value(p).expect("proto"), json!(p.as_str()));
    }
    assert_eq!("Tcp".parse::<Proto>(), Err(UnknownProto("Tcp".into())));
    assert!("OPEN".parse::<Mode>().is_err());
    assert_eq!(
        serde_json::to_value(Problem {
            rule: None,
            message: "m".into()
        })
        .expect("problem"),
        json!({"rule": null, "message": "m"})
    );
}

#[test]
fn entries_cover_and_allow() {
    let all = [
        Entry::Any,
        Entry::Proto(TCP),
        Entry::Proto(UDP),
        Entry::Port(TCP, 443),
        Entry::Port(TCP, 80),
        Entry::Port(UDP, 443),
    ];
    for a in all {
        for b in all {
            let want = a == b
                || a == Entry::Any
                || (a == Entry::Proto(TCP) && b.proto() == Some(TCP) && b.port().is_some())
                || (a == Entry::Proto(UDP) && b == Entry::Port(UDP, 443));
            assert_eq!(a.covers(b), want, "{a} covers {b}");
        }
    }
    assert!(Entry::Port(TCP, 443).allows(TCP, 443));
    assert!(!Entry::Port(TCP, 443).allows(UDP, 443));
    assert!(!Entry::Port(TCP, 443).allows(TCP, 80));
    assert!(Entry::Proto(UDP).allows(UDP, 9));
    assert!(!Entry::Proto(UDP).allows(TCP, 9));
    assert!(Entry::Any.allows(UDP, 0));
}

// --- judging packets ---

#[test]
fn rules_allow_by_network_and_entry() {
    let p = allowlist(vec![
        rule("10.0.0.0/8", Entry::Port(TCP, 5151)),
        rule("91.189.88.0/21", Entry::Proto(TCP)),
        rule("0.0.0.0/0", Entry::Port(UDP, 53)),
        rule("192.0.2.7/32", Entry::Any),
    ]);
    let cases = [
        ("10.9.9.9", TCP, 5151, true),
        ("10.9.9.9", UDP, 5151, false),
        ("10.9.9.9", TCP, 5152, false),
        ("11.0.0.1", TCP, 5151, false),
        ("91.189.95.255", TCP, 1, true),
        ("91.189.96.0", TCP, 1, false),
        ("91.189.88.1", UDP, 53, true),
        ("8.8.8.8", UDP, 53, true),
        ("8.8.8.8", TCP, 53, false),
        ("192.0.2.7", UDP, 9999, true),
        ("192.0.2.8", UDP, 9999, false),
    ];
    for (addr, proto, port, want) in cases {
        assert_eq!(
            p.rules_allow(ip(addr), proto, port),
            want,
            "{addr} {proto}/{port}"
        );
    }
}

#[test]
fn passes_per_mode() {
    let rules = vec![rule("10.0.0.0/8", Entry::Port(TCP, 443))];
    let (inside, outside) = (ip("10.1.1.1"), ip("8.8.8.8"));
    for (mode, rules, want_in, want_out) in [
        (Mode::Loopback, vec![], false, false),
        (Mode::Open, vec![], true, true),
        (Mode::Audit, rules.clone(), true, true),
        (Mode::Allowlist, rules, true, false),
        (Mode::Allowlist, vec![], false, false),
    ] {
        let p = MachineEgress { mode, rules };
        assert_eq!(p.passes(inside, TCP, 443), want_in, "{mode}");
        assert_eq!(p.passes(outside, TCP, 443), want_out, "{mode}");
        assert!(!p.rules_allow(outside, TCP, 443));
    }
}

// --- kernel sets ---

#[test]
fn kernel_sets_drop_duplicates_and_redundant_rules() {
    let p = allowlist(vec![
        rule("10.0.0.0/8", Entry::Proto(TCP)),
        rule("10.1.0.0/16", Entry::Port(TCP, 443)), // inside tcp/any on 10/8
        rule("10.1.0.0/16", Entry::Port(UDP, 53)),  // inside udp/53 on 0/0
        rule("10.0.0.0/8", Entry::Proto(TCP)),      // duplicate
        rule("192.168.0.0/16", Entry::Any),
        rule("192.168.1.0/24", Entry::Proto(UDP)), // inside any
        rule("192.168.1.7/32", Entry::Port(TCP, 22)), // inside any
        rule("0.0.0.0/0", Entry::Port(UDP, 53)),
        rule("172.16.0.0/12", Entry::Port(TCP, 80)),
        rule("172.16.0.0/12", Entry::Port(TCP, 8080)),
        rule("10.2.0.0/16", Entry::Proto(UDP)), // wider entry, narrower network: both stay
        rule("172.16.0.0/12", Entry::Port(TCP, 80)), // duplicate
        rule("172.16.0.0/16", Entry::Port(UDP, 80)), // other proto: stays
    ]);
    assert_eq!(
        p.kernel_sets(),
        KernelSets {
            any: vec![net("192.168.0.0/16")],
            proto: vec![(net("10.0.0.0/8"), TCP), (net("10.2.0.0/16"), UDP)],
            port: vec![
                (net("0.0.0.0/0"), UDP, 53),
                (net("172.16.0.0/12"), TCP, 80),
                (net("172.16.0.0/12"), TCP, 8080),
                (net("172.16.0.0/16"), UDP, 80),
            ],
        }
    );
    assert_eq!(
        MachineEgress::loopback().kernel_sets(),
        KernelSets::default()
    );
}

fn arb_net() -> impl Strategy<Value = Ipv4Net> {
    // Few distinct bits so networks nest and collide.
    (
        0u32..16,
        prop::sample::select(vec![0u8, 24, 26, 28, 30, 31, 32]),
    )
        .prop_map(|(a, len)| Ipv4Net::new_assert(Ipv4Addr::from(0x0a00_0000 | a), len).trunc())
}

fn arb_proto() -> impl Strategy<Value = Proto> {
    prop::sample::select(Proto::ALL.to_vec())
}

fn arb_port() -> impl Strategy<Value = u16> {
    prop::sample::select(vec![1u16, 22, 53, 80, 443])
}

fn arb_entry() -> impl Strategy<Value = Entry> {
    let proto = prop::sample::select(Proto::ALL.to_vec());
    prop_oneof![
        Just(Entry::Any),
        proto.clone().prop_map(Entry::Proto),
        (proto, prop::sample::select(vec![22u16, 53, 80, 443]))
            .prop_map(|(p, n)| Entry::Port(p, n)),
    ]
}

proptest! {
    #[test]
    fn kernel_sets_allow_what_the_rules_allow(
        rules in prop::collection::vec((arb_net(), arb_entry()), 0..24),
        probes in prop::collection::vec((0u32..16, arb_proto(), arb_port()), 1..32),
    ) {
        let p = allowlist(rules.into_iter().map(|(n, e)| Rule::new(n, e, None)).collect());
        let sets = p.kernel_sets();
        for (a, proto, port) in probes {
            let addr = Ipv4Addr::from(0x0a00_0000 | a);
            let by_sets = sets.any.iter().any(|n| n.contains(&addr))
                || sets.proto.iter().any(|(n, q)| n.contains(&addr) && *q == proto)
                || sets.port.iter().any(|(n, q, m)| n.contains(&addr) && *q == proto && *m == port);
            let by_rules = p.rules_allow(addr, proto, port);
            prop_assert_eq!(by_sets, by_rules, "{} {}/{}", addr, proto, port);
        }
        let overlap = |a: &Ipv4Net, b: &Ipv4Net| a.contains(b) || b.contains(a);
        for (i, a) in sets.any.iter().enumerate() {
            prop_assert!(sets.any[i + 1..].iter().all(|b| !overlap(a, b)));
        }
        for (i, (a, p)) in sets.proto.iter().enumerate() {
            prop_assert!(sets.proto[i + 1..].iter().all(|(b, q)| p != q || !overlap(a, b)));
        }
        for (i, (a, p, n)) in sets.port.iter().enumerate() {
            let later = &sets.port[i + 1..];
            prop_assert!(later.iter().all(|(b, q, m)| (p, n) != (q, m) || !overlap(a, b)));
        }
    }
}

// --- check ---

#[test]
fn check_reports_the_normal_form_or_every_problem() {
    let (valid, out) = check(r#"{"rules": [{"cidr": "192.0.2.1", "proto": "udp", "port": 53}]}"#);
    assert!(valid);
    assert_eq!(
        out,
        json!({"valid": true, "policy": {
            "mode": "allowlist",
            "rules": [{"cidr": "192.0.2.1/32", "proto": "udp", "port": 53}],
        }})
    );
    let (valid, out) =
        check(r#"{"mode": "x", "rules": [{"cidr": "10.0.0.0/8"}, {"cidr": "1.2.3.4/8"}]}"#);
    assert!(!valid);
    assert_eq!(out["valid"], json!(false));
    let errors = out["errors"].as_array().expect("errors");
    assert_eq!(errors.len(), 2);
    assert_eq!(errors[0]["rule"], Value::Null);
    assert_eq!(errors[1]["rule"], json!(1));
    assert!(errors[1]["message"]
        .as_str()
        .expect("message")
        .contains("1.0.0.0/8"));
    assert_eq!(errors[0].as_object().expect("object").len(), 2);
    let (valid, out) = check("not json");
    assert!(!valid);
    assert_eq!(out["errors"][0]["rule"], Value::Null);
}

// --- suggest ---

fn obs(addr: &str, proto: Proto, port: u16, names: &[&str]) -> Observed {
    Observed {
        addr: ip(addr),
        proto,
        port,
        names: names.iter().map(|s| s.to_string()).collect(),
        count: 1,
    }
}

/// Asserts what every suggestion must be, and returns it.
fn suggested(current: &MachineEgress, observed: &[Observed]) -> Suggestion {
    let s = suggest(current, observed);
    if let Err(p) = s.policy.validate() {
        panic!("invalid suggestion {:?}: {p:?}", s.policy.to_value());
    }
    assert_eq!(s.policy.rules[..current.rules.len()], current.rules[..]);
    assert_eq!(s.policy.rules[current.rules.len()..], s.added[..]);
    if current.mode != Mode::Open {
        for o in observed {
            let covered = s.policy.rules_allow(o.addr, o.proto, o.port);
            let listed = s
                .uncovered
                .iter()
                .any(|u| (u.addr, u.proto, u.port) == (o.addr, o.proto, o.port));
            assert!(
                covered != listed,
                "{o:?}: allowed {covered}, listed uncovered {listed}"
            );
        }
    }
    s
}

fn has_note(s: &Suggestion, needle: &str) -> bool {
    s.notes.iter().any(|n| n.contains(needle))
}

#[test]
fn suggest_from_loopback_adds_host_rules_and_switches_to_allowlist() {
    let observed = [
        obs("203.0.113.5", TCP, 443, &["api.example.test"]),
        obs("198.51.100.7", UDP, 123, &[]),
        obs(
            "203.0.113.5",
            TCP,
            443,
            &["cdn.example.test", "api.example.test"],
        ),
    ];
    let s = suggested(&MachineEgress::loopback(), &observed);
    assert_eq!(s.policy.mode, Mode::Allowlist);
    assert_eq!(
        s.added,
        [
            Rule::new(
                net("198.51.100.7/32"),
                Entry::Port(UDP, 123),
                Some("observed".into())
            ),
            Rule::new(
                net("203.0.113.5/32"),
                Entry::Port(TCP, 443),
                Some("observed: api.example.test, cdn.example.test".into())
            ),
        ]
    );
    assert!(has_note(&s, "loopback becomes allowlist"), "{:?}", s.notes);
    assert!(s.uncovered.is_empty());

    let nothing = suggested(&MachineEgress::loopback(), &[]);
    assert_eq!(nothing.policy, MachineEgress::loopback());
}

#[test]
fn suggest_skips_what_the_current_rules_allow() {
    let current = allowlist(vec![rule("10.0.0.0/8", Entry::Port(TCP, 443))]);
    let s = suggested(
        &current,
        &[
            obs("10.1.1.1", TCP, 443, &[]),
            obs("10.1.1.1", TCP, 80, &[]),
            obs("10.1.1.1", TCP, 80, &[]),
        ],
    );
    assert_eq!(s.policy.mode, Mode::Allowlist);
    assert_eq!(
        s.added,
        [Rule::new(
            net("10.1.1.1/32"),
            Entry::Port(TCP, 80),
            Some("observed".into())
        )]
    );
    assert!(
        has_note(&s, "1 observed destination already allowed"),
        "{:?}",
        s.notes
    );

    let s = suggested(&current, &[obs("10.1.1.1", TCP, 443, &[])]);
    assert_eq!(s.policy, current);
    assert!(s.added.is_empty());
}

#[test]
fn suggest_keeps_audit_and_leaves_open_alone() {
    let audit = MachineEgress {
        mode: Mode::Audit,
        rules: vec![],
    };
    let s = suggested(&audit, &[obs("192.0.2.1", UDP, 53, &["dns"])]);
    assert_eq!(s.policy.mode, Mode::Audit);
    assert_eq!(s.added.len(), 1);
    assert!(has_note(
        &s,
        "mode stays audit: set mode allowlist to enforce"
    ));

    let open = MachineEgress {
        mode: Mode::Open,
        rules: vec![],
    };
    let s = suggested(&open, &[obs("192.0.2.1", UDP, 53, &["dns"])]);
    assert_eq!(s.policy, open);
    assert!(s.added.is_empty() && s.uncovered.is_empty());
    assert!(has_note(&s, "open allows everything"), "{:?}", s.notes);
}

#[test]
fn suggested_notes_are_truncated_and_printable() {
    let names: Vec<String> = (0..100)
        .map(|i| format!("host-{i:03}.example.test"))
        .collect();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    let s = suggested(
        &MachineEgress::loopback(),
        &[
            obs("192.0.2.1", TCP, 443, &names),
            obs("192.0.2.2", TCP, 443, &["bad\nname", "", "\u{1b}[31m"]),
        ],
    );
    let long = s.added[0].note.as_deref().expect("note");
    assert_eq!(long.chars().count(), MAX_NOTE_CHARS);
    assert!(long.starts_with("observed: host-000.example.test, host-001.example.test"));
    assert!(long.ends_with('…'));
    let odd = s.added[1].note.as_deref().expect("note");
    assert_eq!(odd, "observed: bad\u{fffd}name, \u{fffd}[31m");
}

#[test]
fn suggest_widens_ports_when_an_address_would_carry_too_many() {
    // Six tcp ports and one udp at one address: tcp widens.
    let mut observed: Vec<Observed> = [22, 80, 443, 8080, 8443, 9000]
        .iter()
        .map(|&p| obs("192.0.2.1", TCP, p, &[]))
        .collect();
    observed.push(obs("192.0.2.1", UDP, 53, &[]));
    let s = suggested(&MachineEgress::loopback(), &observed);
    let entries: Vec<Entry> = s.added.iter().map(Rule::entry).collect();
    assert_eq!(entries, [Entry::Proto(TCP), Entry::Port(UDP, 53)]);
    assert!(
        has_note(
            &s,
            "192.0.2.1/32: allows tcp/any, udp/53 for the observed tcp/22"
        ),
        "{:?}",
        s.notes
    );

    // The current rules around the address count: 3 inherited + 2 ports is 5.
    let current = allowlist(vec![
        rule("0.0.0.0/0", Entry::Port(UDP, 53)),
        rule("10.0.0.0/8", Entry::Port(UDP, 123)),
        rule("10.1.0.0/16", Entry::Port(TCP, 22)),
    ]);
    let s = suggested(
        &current,
        &[
            obs("10.1.2.3", TCP, 80, &[]),
            obs("10.1.2.3", TCP, 443, &[]),
        ],
    );
    assert_eq!(
        s.added,
        [Rule::new(
            net("10.1.2.3/32"),
            Entry::Proto(TCP),
            Some("observed".into())
        )]
    );

    // Then to any: no per-protocol widening fits beside 3 inherited entries.
    let current = allowlist(vec![
        rule("0.0.0.0/0", Entry::Port(UDP, 53)),
        rule("0.0.0.0/0", Entry::Port(TCP, 22)),
        rule("0.0.0.0/0", Entry::Port(UDP, 123)),
    ]);
    let s = suggested(
        &current,
        &[
            obs("10.1.2.3", TCP, 80, &[]),
            obs("10.1.2.3", UDP, 5000, &[]),
        ],
    );
    assert_eq!(
        s.added,
        [Rule::new(
            net("10.1.2.3/32"),
            Entry::Any,
            Some("observed".into())
        )]
    );
}

#[test]
fn suggest_turns_port_0_into_proto_any() {
    let s = suggested(
        &MachineEgress::loopback(),
        &[
            obs("192.0.2.1", UDP, 0, &[]),
            obs("192.0.2.1", UDP, 53, &[]),
        ],
    );
    assert_eq!(
        s.added,
        [Rule::new(
            net("192.0.2.1/32"),
            Entry::Proto(UDP),
            Some("observed".into())
        )]
    );
    assert!(has_note(&s, "port 0"), "{:?}", s.notes);
}

#[test]
fn suggest_aggregates_to_stay_within_the_rule_limit() {
    let observed: Vec<Observed> = (0..300u32)
        .map(|i| obs(&format!("10.0.{}.{}", i / 150, i % 150 + 1), TCP, 443, &[]))
        .collect();
    let s = suggested(&MachineEgress::loopback(), &observed);
    assert!(s.uncovered.is_empty());
    // One /24 is enough: 1 + 150 rules.
    assert_eq!(s.added.len(), 151);
    assert_eq!(
        s.added.iter().filter(|r| r.net.prefix_len() == 24).count(),
        1
    );
    assert!(
        has_note(
            &s,
            "aggregated 150 observed destinations into 1 rule at /24"
        ),
        "{:?}",
        s.notes
    );
}

#[test]
fn suggest_does_not_aggregate_over_a_full_current_network() {
    // 10.0.5.0/28 carries 4 entries: no block containing it can add tcp/443.
    let current = allowlist(
        (1..=4)
            .map(|p| rule("10.0.5.0/28", Entry::Port(TCP, p)))
            .collect(),
    );
    let mut observed: Vec<Observed> = (0..4u32)
        .flat_map(|b| (1..=80u32).map(move |h| (b, h)))
        .map(|(b, h)| obs(&format!("10.0.{b}.{h}"), TCP, 443, &[]))
        .collect();
    observed.extend((100..=120).map(|h| obs(&format!("10.0.5.{h}"), TCP, 443, &[])));
    let s = suggested(&current, &observed);
    assert!(s.uncovered.is_empty());
    assert!(
        s.added.iter().all(|r| !r.net.contains(&net("10.0.5.0/28"))),
        "{:?}",
        s.added
    );
    assert!(s.policy.rules.len() <= MAX_RULES);
}

#[test]
fn suggest_widens_to_everywhere_as_a_last_resort() {
    let current = allowlist(
        (0..250u32)
            .map(|i| rule(&format!("192.168.0.{i}/32"), Entry::Port(TCP, 22)))
            .collect(),
    );
    let observed: Vec<Observed> = (1..=20u16)
        .map(|i| obs(&format!("{i}.0.0.1"), TCP, 1000 + i, &[]))
        .collect();
    let s = suggested(&current, &observed);
    assert!(s.uncovered.is_empty());
    assert_eq!(s.added.len(), 1);
    assert_eq!(
        (s.added[0].net, s.added[0].entry()),
        (Ipv4Net::default(), Entry::Proto(TCP))
    );
    assert!(has_note(&s, "at /0"), "{:?}", s.notes);
}

#[test]
fn suggest_adds_nothing_when_the_rules_are_full() {
    let current = allowlist(vec![rule("10.0.0.0/8", Entry::Port(TCP, 443)); MAX_RULES]);
    let observed = [
        obs("192.0.2.1", TCP, 80, &[]),
        obs("10.0.0.1", TCP, 443, &[]),
    ];
    let s = suggested(&current, &observed);
    assert_eq!(s.policy, current);
    assert!(s.added.is_empty());
    assert!(has_note(&s, "nothing could be added"), "{:?}", s.notes);
    assert_eq!(s.uncovered, [observed[0].clone()]);
}

#[test]
fn suggest_names_what_no_rule_can_cover() {
    // 10/8 already carries 4 entries: any rule for 10.1.1.1 udp/53 would make 5.
    let current = allowlist(
        (1..=4)
            .map(|p| rule("10.0.0.0/8", Entry::Port(TCP, p)))
            .collect(),
    );
    let s = suggested(
        &current,
        &[obs("10.1.1.1", UDP, 53, &[]), obs("11.0.0.1", TCP, 80, &[])],
    );
    assert_eq!(
        s.added,
        [Rule::new(
            net("11.0.0.1/32"),
            Entry::Port(TCP, 80),
            Some("observed".into())
        )]
    );
    assert_eq!(s.uncovered.len(), 1);
    assert_eq!(
        (s.uncovered[0].addr, s.uncovered[0].port),
        (ip("10.1.1.1"), 53)
    );
    assert!(
        has_note(&s, "could not add 1 observed destination (10.1.1.1 udp/53)"),
        "{:?}",
        s.notes
    );

    // With one rule of room and two destinations no single rule may cover,
    // the one seen least is left out.
    let mut rules: Vec<Rule> = (1..=4)
        .map(|p| rule("10.0.0.0/8", Entry::Port(TCP, p)))
        .collect();
    rules.extend((0..251u32).map(|i| rule(&format!("192.168.0.{i}/32"), Entry::Port(TCP, 22))));
    let current = allowlist(rules);
    let mut seen_more = obs("12.0.0.1", TCP, 6, &[]);
    seen_more.count = 10;
    let s = suggested(&current, &[obs("11.0.0.1", TCP, 5, &[]), seen_more]);
    assert_eq!(s.added.len(), 1);
    assert_eq!(s.added[0].net, net("12.0.0.1/32"));
    assert_eq!(s.uncovered.len(), 1);
    assert!(
        has_note(&s, "those seen least (11.0.0.1 tcp/5)"),
        "{:?}",
        s.notes
    );
}

/// Whether some network of `p` carries the most entries.
fn has_full_network(p: &MachineEgress) -> bool {
    p.rules.iter().any(|r| {
        let carried: std::collections::BTreeSet<Entry> = p
            .rules
            .iter()
            .filter(|c| c.net.contains(&r.net))
            .map(Rule::entry)
            .collect();
        carried.len() >= MAX_ENTRIES_PER_NETWORK
    })
}

fn arb_current() -> impl Strategy<Value = MachineEgress> {
    (
        prop::collection::vec((arb_net(), arb_entry()), 0..40),
        prop::sample::select(Mode::ALL.to_vec()),
    )
        .prop_map(|(candidates, mode)| {
            if matches!(mode, Mode::Loopback | Mode::Open) {
                return MachineEgress {
                    mode,
                    rules: vec![],
                };
            }
            // Keep each candidate that leaves the policy valid.
            let mut p = MachineEgress {
                mode,
                rules: vec![],
            };
            for (n, e) in candidates {
                p.rules.push(Rule::new(n, e, None));
                if p.validate().is_err() {
                    p.rules.pop();
                }
            }
            p
        })
}

fn arb_observed() -> impl Strategy<Value = Observed> {
    let addr = prop_oneof![
        (0u32..16).prop_map(|a| Ipv4Addr::from(0x0a00_0000 | a)),
        (0u32..4, 0u32..256, 0u32..256)
            .prop_map(|(a, b, c)| Ipv4Addr::from(0x0a00_0000 | a << 16 | b << 8 | c)),
        any::<u32>().prop_map(Ipv4Addr::from),
    ];
    let port = prop_oneof![
        prop::sample::select(vec![0u16, 22, 53, 80, 443, 8080]),
        any::<u16>()
    ];
    let names = prop::collection::vec(
        prop::sample::select(vec!["a.example.test", "b.example.test", "c\u{7}.test"]),
        0..3,
    );
    (
        addr,
        prop::sample::select(Proto::ALL.to_vec()),
        port,
        names,
        1u64..100,
    )
        .prop_map(|(addr, proto, port, names, count)| Observed {
            addr,
            proto,
            port,
            names: names.into_iter().map(String::from).collect(),
            count,
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn every_suggestion_validates_and_covers_what_it_can(
        current in arb_current(),
        observed in prop_oneof![
            prop::collection::vec(arb_observed(), 0..40),
            prop::collection::vec(arb_observed(), 250..3000),
        ],
    ) {
        // `suggested` asserts validity, the current rules kept first, and
        // that every destination is allowed or listed as uncovered.
        let s = suggested(&current, &observed);
        if !has_full_network(&current) {
            prop_assert!(s.uncovered.is_empty(), "{:?}", s.notes);
        }
        let want_mode = match current.mode {
            Mode::Loopback if !s.added.is_empty() => Mode::Allowlist,
            m => m,
        };
        prop_assert_eq!(s.policy.mode, want_mode);
        for r in &s.added {
            prop_assert!(r.note.as_deref().is_some_and(|n| n.starts_with("observed")));
        }
    }
}
