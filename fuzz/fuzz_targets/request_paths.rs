//! Request targets as the per-request rules read them
//! (`egress_policy::http::normalize` and `CompiledPolicy::judge_request`).
//!
//! Input: `[method][target…]` (UTF-8); the method byte picks (mod 4) GET,
//! POST, DELETE or OPTIONS.
//!
//! Properties: a normal form is its own normal form, absolute, with no
//! empty, `.` or `..` segment and no query; and a request is judged on its
//! normal form alone: the raw target and its normal form get the same
//! judgement from a policy with qualified allows, denies and audits.
#![no_main]

use std::sync::{Arc, OnceLock};

use egress_policy::http::normalize;
use egress_policy::{CompiledPolicy, Hostname, PlatformDenies, Policy};
use libfuzzer_sys::fuzz_target;

fn policy() -> &'static CompiledPolicy {
    static P: OnceLock<CompiledPolicy> = OnceLock::new();
    P.get_or_init(|| {
        let doc = r#"{"tls_interception": "on",
            "allow": [{"domain": "api.test", "http": {"methods": ["GET"], "paths": ["/repos/*/issues", "/a/b"]}},
                      {"domain": "api.test", "http": {"methods": ["POST"], "paths": ["/repos/*/issues/*/comments"]}},
                      {"domain": "api.test", "http": "read_only", "mode": "audit"}],
            "deny": [{"domain": "api.test", "http": {"methods": ["POST", "DELETE"], "paths": ["/gists", "/*/admin"]}},
                     {"domain": "api.test", "http": {"paths": ["/x/y"]}, "mode": "audit"}]}"#;
        let policy = Policy::from_json(doc).unwrap_or_default();
        CompiledPolicy::new(policy, Arc::new(PlatformDenies::builtin()))
    })
}

fuzz_target!(|input: &[u8]| {
    let Some((&m, rest)) = input.split_first() else {
        return;
    };
    let Ok(target) = std::str::from_utf8(rest) else {
        return;
    };
    let method = ["GET", "POST", "DELETE", "OPTIONS"][usize::from(m % 4)];
    let first = normalize(target);
    assert_eq!(first, normalize(target), "not deterministic");
    let host = Hostname::parse("api.test").expect("valid");
    let names = [&host];
    let judged = policy().judge_request(&names, method, target);
    let Ok(normal) = first else {
        return;
    };
    assert_eq!(
        normalize(&normal).as_ref(),
        Ok(&normal),
        "{target:?} → {normal:?} is not stable"
    );
    if normal != "*" {
        assert!(normal.starts_with('/'), "{normal:?}");
        assert!(!normal.contains('?') && !normal.contains('#'), "{normal:?}");
        for seg in normal.split('/').skip(1) {
            assert!(
                normal == "/" || (!seg.is_empty() && seg != "." && seg != ".."),
                "{target:?} → {normal:?}"
            );
        }
    }
    assert_eq!(
        judged,
        policy().judge_request(&names, method, &normal),
        "{method} {target:?} and its normal form {normal:?} are judged differently"
    );
});
