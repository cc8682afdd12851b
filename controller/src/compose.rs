//! A sandbox's effective policy: a base (the tenant's policy, or the
//! template's default when it inherits) composed with the selected operator
//! profiles and the deployment exemptions — and which source added which rule.

use egress_policy::{compose, resolve_saved, Destination, MissingProfile, Policy, ProfileName};
use serde::Serialize;

use crate::config::Deployment;

/// Why an effective `policy`, pushed with `addresses`, is larger than a
/// gateway takes (`None`: it is not). Checked before such a policy is saved,
/// so that what the API acknowledges is what the gateway enforces.
pub fn oversized(policy: &Policy, addresses: &[String]) -> Option<String> {
    use egress_api::body::MAX_BODY;
    let doc = egress_api::gateway::PutSandbox {
        addresses: addresses.iter().filter_map(|a| a.parse().ok()).collect(),
        policy: policy.clone(),
        credentials: Vec::new(),
        upstream_proxy: None,
        revision: Some(u64::MAX),
    };
    let bytes = serde_json::to_vec(&doc).map_or(usize::MAX, |b| b.len());
    (bytes > MAX_BODY).then(|| {
        format!("policy: the effective policy (profiles, exemptions and approvals added) makes a {bytes}-byte document for the gateway, which takes at most {MAX_BODY}")
    })
}

/// One rule composition added, and who added it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Added {
    /// `allow` or `tls_interception_exemptions`.
    pub list: &'static str,
    pub destination: Destination,
    /// `profile:<name>`, `resolver_allowance` or `deployment`.
    pub source: String,
}

/// The outcome of composing a sandbox's policy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Effective {
    pub policy: Policy,
    /// Whether the sandbox still runs its template's policy as it is.
    pub inherits_template: bool,
    pub provenance: Vec<Added>,
}

/// Composes `base` with the saved profile `names`, resolved against this
/// process's configuration (defaults are never added here), and the
/// deployment exemptions. `inherit`: `base` is the template's default; it
/// stays an inheritance unless composition changed it.
pub fn effective(
    deployment: &Deployment,
    base: &Policy,
    names: &[String],
    inherit: bool,
) -> Result<Effective, MissingProfile> {
    let resolved = resolve_saved(&deployment.profiles, names)?;
    let composed = compose(
        base,
        resolved.iter().map(|(_, p)| *p),
        deployment.exemptions.as_ref(),
    );
    let provenance = provenance(base, &composed.policy, &resolved);
    Ok(Effective {
        inherits_template: inherit && !composed.changed,
        policy: composed.policy,
        provenance,
    })
}

/// Names the source of every rule in `policy` that `base` did not have.
fn provenance(
    base: &Policy,
    policy: &Policy,
    resolved: &[(&ProfileName, &egress_policy::Profile)],
) -> Vec<Added> {
    let mut out = Vec::new();
    // Composition adds whole-destination allows only, and only where the
    // base has no entry that is exactly the destination (one with `http`,
    // `streams` or an `until` does not cover it: `push_new_rule`).
    let whole = |rules: &[egress_policy::Rule]| -> Vec<Destination> {
        rules
            .iter()
            .filter(|r| **r == r.dest)
            .map(|r| r.dest.clone())
            .collect()
    };
    let (base_allow, allow) = (whole(&base.allow), whole(&policy.allow));
    let lists: [(&'static str, &[Destination], &[Destination]); 2] = [
        ("allow", &base_allow, &allow),
        (
            "tls_interception_exemptions",
            &base.tls_interception_exemptions,
            &policy.tls_interception_exemptions,
        ),
    ];
    for (list, before, after) in lists {
        // A set: a list of tens of thousands would otherwise be compared
        // with itself entry by entry, under the sandbox row's lock.
        let before: std::collections::HashSet<&Destination> = before.iter().collect();
        for d in after.iter().filter(|d| !before.contains(d)) {
            let from_profile = resolved.iter().find(|(_, p)| {
                let entries = if list == "allow" {
                    &p.allow
                } else {
                    &p.tls_interception_exemptions
                };
                entries.iter().any(|e| e.get() == d)
            });
            let source = match (from_profile, list) {
                (Some((name, _)), _) => format!("profile:{name}"),
                (None, "allow") => "resolver_allowance".to_owned(),
                (None, _) => "deployment".to_owned(),
            };
            out.push(Added {
                list,
                destination: d.clone(),
                source,
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn deployment() -> Deployment {
        Deployment::from_values(
            Some(
                r#"{"audit": {"default": true, "allow": [{"domain": "audit.example.test"}]},
                    "sensor": {"allow": [{"domain": "sensor.example.test"}],
                               "tls_interception_exemptions": [{"domain": "sensor.example.test"}]}}"#,
            ),
            Some(r#"[{"wildcard_domain": "*.relay.example.test"}]"#),
        )
        .expect("valid")
    }

    fn policy(s: &str) -> Policy {
        Policy::from_json(s).expect(s)
    }

    #[test]
    fn composition_names_each_rules_source() {
        let d = deployment();
        let base = policy(r#"{"default": "deny", "tls_interception": "on"}"#);
        let e = effective(&d, &base, &["sensor".into()], false).expect("configured");
        let sources: Vec<(&str, String)> = e
            .provenance
            .iter()
            .map(|a| (a.list, a.source.clone()))
            .collect();
        assert_eq!(
            sources,
            [
                ("allow", "profile:sensor".to_owned()),
                ("allow", "resolver_allowance".into()),
                ("allow", "resolver_allowance".into()),
                ("tls_interception_exemptions", "profile:sensor".into()),
                ("tls_interception_exemptions", "deployment".into()),
            ]
        );
        assert!(!e.inherits_template);
        // A base entry for the profile's destination that is not exactly it
        // (streams, an until) does not cover it: composition adds the
        // profile's, and the provenance names the profile.
        for own in [
            r#"{"domain": "sensor.example.test", "streams": ["ssh"]}"#,
            r#"{"domain": "sensor.example.test", "until": "2999-01-01T00:00:00Z"}"#,
        ] {
            let base = policy(&format!(
                r#"{{"default": "deny", "tls_interception": "on", "allow": [{own}]}}"#
            ));
            let e = effective(&d, &base, &["sensor".into()], false).expect("configured");
            assert_eq!(
                e.policy.allow.len(),
                1 + 1 + 2,
                "{own}: its own, the profile's, the resolvers"
            );
            let named = e
                .provenance
                .iter()
                .any(|a| a.list == "allow" && a.source == "profile:sensor");
            assert!(named, "{own}: the profile's rule has its provenance");
        }
    }

    #[test]
    fn an_inheritance_stays_one_unless_composition_changes_it() {
        let d = deployment();
        let off = policy(r#"{"default": "allow"}"#);
        let e = effective(&d, &off, &[], true).expect("no names");
        assert!(e.inherits_template, "interception off: nothing appended");
        let on = policy(r#"{"default": "allow", "tls_interception": "on"}"#);
        let e = effective(&d, &on, &[], true).expect("no names");
        assert!(!e.inherits_template, "a deployment exemption was added");
        let missing = effective(&d, &off, &["gone".into()], true).expect_err("missing");
        assert_eq!(missing.missing, "gone");
    }
}
