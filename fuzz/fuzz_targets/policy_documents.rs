//! The policy documents the gateway and the controller read from outside.
//!
//! Input: `[selector][text…]`; the selector (mod 5) picks the reader:
//!
//! 0. the effective policy (`egress_policy::from_json::<Policy>`, what the
//!    admin API embeds);
//! 1. `SPACE_EGRESS_PROFILES` (`Profiles::from_env_value`);
//! 2. `SPACE_TLS_INTERCEPTION_EXEMPTIONS` (`DeploymentExemptions::from_env_value`);
//! 3. `X-Space-Egress-Profiles` (`select`, against fixed valid profiles);
//! 4. a machine egress policy (`MachineEgress::from_json`).
//!
//! Properties: whatever parses round-trips — serialised, it parses again to
//! an equal value whose serialisation is the same text (a normal form).
//! A selection keeps every `+name`, drops every `-name`, follows the
//! defaults for the rest, and chooses only configured profiles; a refused
//! one labels its admissions only with configured names or `unknown` (the
//! metric label set stays bounded whatever the header says).
#![no_main]

use std::sync::OnceLock;

use egress_policy::machine::MachineEgress;
use egress_policy::{
    select, CompiledPolicy, DeploymentExemptions, Outcome, PlatformDenies, Policy, Profiles,
    UNKNOWN_PROFILE_LABEL,
};
use libfuzzer_sys::fuzz_target;

fn policy(text: &str) {
    let Ok(p) = egress_policy::from_json::<Policy>(text) else {
        return;
    };
    let normal = serde_json::to_string(&p).expect("a policy serialises");
    let again = egress_policy::from_json::<Policy>(&normal)
        .unwrap_or_else(|e| panic!("normal form {normal} does not parse: {e}"));
    assert_eq!(again, p, "{normal}");
    assert_eq!(serde_json::to_string(&again).expect("serialises"), normal);
    // What the admin does next with a pushed policy.
    let _ = CompiledPolicy::new(p, platform());
}

fn platform() -> std::sync::Arc<PlatformDenies> {
    static P: OnceLock<std::sync::Arc<PlatformDenies>> = OnceLock::new();
    P.get_or_init(|| std::sync::Arc::new(PlatformDenies::builtin()))
        .clone()
}

fn profiles_env(text: &str) {
    let Ok(p) = Profiles::from_env_value(Some(text)) else {
        return;
    };
    let normal = serde_json::to_string(&p).expect("profiles serialise");
    let again = Profiles::from_env_value(Some(&normal))
        .unwrap_or_else(|e| panic!("normal form {normal} does not parse: {e}"));
    assert_eq!(again, p, "{normal}");
    assert_eq!(serde_json::to_string(&again).expect("serialises"), normal);
}

fn exemptions_env(text: &str) {
    let Ok(Some(e)) = DeploymentExemptions::from_env_value(Some(text)) else {
        return;
    };
    assert!(!e.is_empty(), "an empty exemption list is refused");
    let normal = serde_json::to_string(&e).expect("exemptions serialise");
    let again = DeploymentExemptions::from_env_value(Some(&normal))
        .unwrap_or_else(|err| panic!("normal form {normal} does not parse: {err}"));
    assert_eq!(again, Some(e), "{normal}");
}

/// Three profiles, `base` a default.
fn configured() -> &'static Profiles {
    static P: OnceLock<Profiles> = OnceLock::new();
    P.get_or_init(|| {
        Profiles::from_env_value(Some(
            r#"{
                "base": {"default": true, "allow": [{"domain": "pypi.example.test"}]},
                "research": {"allow": [{"cidr": "198.51.100.0/24"}]},
                "gpu-2": {"allow": [{"ip": "203.0.113.7"}],
                          "tls_interception_exemptions": [{"domain": "pinned.example.test"}]}
            }"#,
        ))
        .expect("valid profiles")
    })
}

fn header(text: &str, federated: bool) {
    let profiles = configured();
    let first = select(profiles, Some(text), federated);
    assert_eq!(
        first,
        select(profiles, Some(text), federated),
        "deterministic"
    );
    match first {
        Ok(sel) => {
            if !federated {
                assert!(sel.profiles.is_empty(), "unfederated selects nothing");
                return;
            }
            let chosen: Vec<&str> = sel.profiles.iter().map(|p| p.as_str()).collect();
            let mut sorted = chosen.clone();
            sorted.sort_unstable();
            sorted.dedup();
            assert_eq!(sorted, chosen, "chosen once each, in order");
            assert_eq!(sel.admissions.len(), sel.profiles.len());
            for (a, p) in sel.admissions.iter().zip(&sel.profiles) {
                assert_eq!((a.profile.as_str(), a.outcome), (p.as_str(), Outcome::Ok));
            }
            // The model: +name kept, -name dropped, otherwise the default.
            for (name, profile) in profiles.iter() {
                let name = name.as_str();
                let plus = text.split(' ').any(|t| t.strip_prefix('+') == Some(name));
                let minus = text.split(' ').any(|t| t.strip_prefix('-') == Some(name));
                let want = plus || (!minus && profile.default);
                assert_eq!(chosen.contains(&name), want, "{name} in {text:?}");
            }
            for c in &chosen {
                assert!(profiles.get(c).is_some(), "{c} is not configured");
            }
        }
        Err(e) => {
            for a in &e.admissions {
                assert_eq!(a.outcome, Outcome::Failed);
                assert!(
                    a.profile == UNKNOWN_PROFILE_LABEL || profiles.get(&a.profile).is_some(),
                    "label {:?} from the header",
                    a.profile
                );
            }
            // Quotes at most one token (Debug-escaped), and a bounded remark.
            assert!(e.message.len() <= 10 * text.len() + 128, "{}", e.message);
        }
    }
}

fn machine(text: &str) {
    let Ok(p) = MachineEgress::from_json(text) else {
        return;
    };
    let normal = p.to_value().to_string();
    let again = MachineEgress::from_json(&normal)
        .unwrap_or_else(|e| panic!("normal form {normal} does not parse: {e:?}"));
    assert_eq!(again, p, "{normal}");
    assert_eq!(again.to_value().to_string(), normal);
    // Through serde too (the cluster's resource embeds it).
    let via_serde: MachineEgress = serde_json::from_str(&normal).expect("serde reads it");
    assert_eq!(via_serde, p);
}

fuzz_target!(|input: &[u8]| {
    let Some((&selector, rest)) = input.split_first() else {
        return;
    };
    let Ok(text) = std::str::from_utf8(rest) else {
        return;
    };
    match selector % 5 {
        0 => policy(text),
        1 => profiles_env(text),
        2 => exemptions_env(text),
        3 => header(text, selector & 0x80 == 0),
        _ => machine(text),
    }
});
