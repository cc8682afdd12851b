use super::*;

fn profiles() -> Profiles {
    Profiles::from_env_value(Some(
        r#"{"audit": {"default": true, "allow": [{"domain": "audit.example.test"}]},
            "base": {"default": true, "allow": [{"ip": "203.0.113.1"}]},
            "sensor": {"allow": [{"domain": "sensor.example.test"}]},
            "edge-2": {"allow": [{"cidr": "198.51.100.0/24"}]}}"#,
    ))
    .expect("valid profiles")
}

fn names(s: &Selection) -> Vec<&str> {
    s.profiles.iter().map(ProfileName::as_str).collect()
}

fn adm(profile: &str, outcome: Outcome, reason: AdmissionReason) -> Admission {
    Admission {
        profile: profile.into(),
        outcome,
        reason,
    }
}

#[test]
fn absent_header_selects_defaults() {
    let s = select(&profiles(), None, true).expect("ok");
    assert_eq!(names(&s), ["audit", "base"]);
    assert_eq!(
        s.admissions,
        [
            adm("audit", Outcome::Ok, AdmissionReason::Ready),
            adm("base", Outcome::Ok, AdmissionReason::Ready)
        ]
    );
}

#[test]
fn tokens_add_and_remove_from_defaults() {
    let p = profiles();
    let cases: &[(&str, &[&str])] = &[
        ("+sensor -audit", &["base", "sensor"]),
        ("+sensor", &["audit", "base", "sensor"]),
        ("-audit -base", &[]),
        ("+edge-2 -sensor", &["audit", "base", "edge-2"]),
        ("+audit", &["audit", "base"]),
    ];
    for (header, want) in cases {
        let s = select(&p, Some(header), true).expect(header);
        assert_eq!(names(&s), *want, "{header}");
        assert_eq!(s.admissions.len(), want.len());
        assert!(s
            .admissions
            .iter()
            .all(|a| a.outcome == Outcome::Ok && a.reason == AdmissionReason::Ready));
    }
}

#[test]
fn each_invalid_selection_has_its_own_kind() {
    let p = profiles();
    let cases = [
        ("", SelectionErrorKind::Empty),
        (" +sensor", SelectionErrorKind::Malformed),
        ("+sensor ", SelectionErrorKind::Malformed),
        ("+sensor  -audit", SelectionErrorKind::Malformed),
        (" ", SelectionErrorKind::Malformed),
        ("sensor", SelectionErrorKind::Malformed),
        ("+", SelectionErrorKind::Malformed),
        ("+Sensor", SelectionErrorKind::Malformed),
        ("+sensor,-audit", SelectionErrorKind::Malformed),
        ("+sensor\t-audit", SelectionErrorKind::Malformed),
        ("é", SelectionErrorKind::Malformed),
        ("++sensor", SelectionErrorKind::Malformed),
        ("+sensor +sensor", SelectionErrorKind::Repeated),
        ("-audit -audit", SelectionErrorKind::Repeated),
        ("+sensor -sensor", SelectionErrorKind::Conflicting),
        ("-sensor +sensor", SelectionErrorKind::Conflicting),
        ("+nope", SelectionErrorKind::Unknown),
        ("-nope", SelectionErrorKind::Unknown),
        ("+sensor +nope", SelectionErrorKind::Unknown),
    ];
    for (header, kind) in cases {
        let e = select(&p, Some(header), true).expect_err(header);
        assert_eq!(e.kind, kind, "{header:?}: {e}");
        assert!(!e.admissions.is_empty(), "{header:?}");
        assert!(
            e.admissions.iter().all(
                |a| a.outcome == Outcome::Failed && a.reason == AdmissionReason::InvalidRequest
            ),
            "{header:?}"
        );
    }
}

#[test]
fn labels_never_echo_unconfigured_names() {
    let p = profiles();
    let e = select(&p, Some("+sensor +evil-label-value"), true).expect_err("unknown");
    assert_eq!(
        e.admissions,
        [
            adm("sensor", Outcome::Failed, AdmissionReason::InvalidRequest),
            adm(
                UNKNOWN_PROFILE_LABEL,
                Outcome::Failed,
                AdmissionReason::InvalidRequest
            ),
        ]
    );
    let e = select(&p, Some("+x{y=\"z\"}"), true).expect_err("malformed");
    assert_eq!(
        e.admissions,
        [adm(
            "unknown",
            Outcome::Failed,
            AdmissionReason::InvalidRequest
        )]
    );
    let long = format!("+{}", "a".repeat(10_000));
    let e = select(&p, Some(&format!("{long} {long}")), true).expect_err("repeated");
    assert_eq!(e.kind, SelectionErrorKind::Repeated);
    assert_eq!(
        e.admissions,
        [adm(
            "unknown",
            Outcome::Failed,
            AdmissionReason::InvalidRequest
        )]
    );
}

#[test]
fn non_federated_ignores_header_and_defaults() {
    let p = profiles();
    let s = select(&p, None, false).expect("ok");
    assert!(s.profiles.is_empty() && s.admissions.is_empty());
    for header in ["+sensor", "", "garbage  here"] {
        let s = select(&p, Some(header), false).expect("header is ignored, not validated");
        assert!(s.profiles.is_empty(), "{header:?}: not even defaults");
        assert_eq!(
            s.admissions,
            [adm(
                "unknown",
                Outcome::Failed,
                AdmissionReason::InvalidRequest
            )]
        );
    }
}

#[test]
fn disabled_profiles_select_nothing_and_refuse_names() {
    let none = Profiles::default();
    assert!(select(&none, None, true).expect("ok").profiles.is_empty());
    assert_eq!(
        select(&none, Some("+a"), true).expect_err("unknown").kind,
        SelectionErrorKind::Unknown
    );
}

#[test]
fn messages_are_bounded() {
    let long = format!("x{}", "y".repeat(100_000));
    let e = select(&profiles(), Some(&long), true).expect_err("malformed");
    assert!(e.to_string().len() < 200, "{}", e.to_string().len());
}
