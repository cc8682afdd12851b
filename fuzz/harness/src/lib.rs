//! The harness the fuzz targets share: the admin listener's request bodies
//! read as its routes read them (the `admin_bodies` target).
//!
//! The bodies are untrusted bytes. [`admin_body`] reads raw bytes the way
//! the routes do, with the pieces they use: the contract crate's documents
//! and readers ([`egress_api`]: the same UTF-8 check and cap, the same
//! [`egress_policy::from_json`], the same resync and credential checks, the
//! same NDJSON line reader, the explain question), the gateway's registry
//! and decision (compiled in memory, nothing persisted), and machine
//! egress's VM registration reader and address checks ([`egress_machine`],
//! no nftables). What is fuzzed is what the routes run.

use std::net::IpAddr;
use std::sync::{Arc, OnceLock};

use dns_attrib::{AttributionCache, CacheConfig, ManualClock};
use egress_api::body::Lines;
use egress_api::explain::Explain;
use egress_policy::machine::MachineEgress;
use egress_policy::{CompiledPolicy, PlatformDenies, Policy, SandboxId};
use serde::Serialize;
use serde_json::json;

use egress_api::gateway::{PutSandbox, Resync, SandboxDoc};
use egress_gateway::decide::{decide, explained, explained_request, Claims};
use egress_gateway::doh::DohNames;
use egress_gateway::registry::{Extras, Registry};

use egress_api::body::MAX_BODY;

/// The admin bodies [`admin_body`] reads; a fuzzer's byte picks one with
/// [`Route::from_byte`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    /// `PUT /v1/sandboxes/{id}`: `{"addresses", "policy"}`.
    PutSandbox,
    /// `PUT /v1/sandboxes`: `{"sandboxes": [{"id", "addresses", "policy"}]}`.
    Resync,
    /// `PUT /v1/sandboxes` as `application/x-ndjson`: one sandbox per line.
    ResyncNdjson,
    /// `POST /v1/explain`: `{"sandbox", "dst", "tls", "sni", "host"}`.
    Explain,
    /// `PUT /v1/vms/{id}/network/egress` and `/v1/network/egress/defaults`.
    MachineEgress,
    /// `PUT /v1/vms/{id}`: `{"addresses", "egress"}`.
    VmRegistration,
}

// === impl Route ===

impl Route {
    pub const ALL: [Self; 6] = [
        Self::PutSandbox,
        Self::Resync,
        Self::ResyncNdjson,
        Self::Explain,
        Self::MachineEgress,
        Self::VmRegistration,
    ];

    pub fn from_byte(b: u8) -> Self {
        Self::ALL[usize::from(b) % Self::ALL.len()]
    }
}

/// Reads `bytes` as `route`'s body. `Ok`: the admin would accept it, and
/// this is the accepted document in normal form (what the admin stores and
/// answers with), itself a body `route` accepts. `Err`: why the admin
/// answers `4xx`.
pub fn admin_body(route: Route, bytes: &[u8]) -> Result<String, String> {
    // admin's `body_text`: capped, then UTF-8 (NDJSON is checked per line).
    let text = || {
        if bytes.len() > MAX_BODY {
            return Err(format!("body larger than {MAX_BODY} bytes"));
        }
        std::str::from_utf8(bytes).map_err(|_| "body is not UTF-8".to_owned())
    };
    let normal = match route {
        Route::PutSandbox => put_sandbox(text()?)?,
        Route::Resync => {
            let doc: Resync = egress_policy::from_json(text()?).map_err(|e| e.to_string())?;
            let sandboxes = resync(doc.sandboxes)?;
            to_json(&Resync { sandboxes })?
        }
        Route::ResyncNdjson => resync_ndjson(bytes)?,
        Route::Explain => explain(text()?)?,
        Route::MachineEgress => MachineEgress::from_json(text()?)
            .map_err(|p| format!("{p:?}"))?
            .to_value()
            .to_string(),
        Route::VmRegistration => {
            let (addresses, egress) = registration(text()?)?;
            let mut doc = json!({ "addresses": addresses });
            if let Some(e) = egress {
                doc["egress"] = e.to_value();
            }
            doc.to_string()
        }
    };
    Ok(normal)
}

fn to_json<T: Serialize>(v: &T) -> Result<String, String> {
    serde_json::to_string(v).map_err(|e| e.to_string())
}

fn registry() -> Registry {
    Registry::new(Arc::new(PlatformDenies::builtin()))
}

fn put_sandbox(text: &str) -> Result<String, String> {
    let doc: PutSandbox = egress_policy::from_json(text).map_err(|e| e.to_string())?;
    egress_api::gateway::credentials::validate(&doc.credentials)?;
    let registry = registry();
    let extras = Extras {
        credentials: doc.credentials,
        upstream_proxy: doc.upstream_proxy,
        shadow: None,
        revision: doc.revision,
    };
    let sandbox = registry.prepare_with(SandboxId::new("fuzz"), doc.addresses, doc.policy, extras);
    registry
        .put_prepared(sandbox.clone())
        .map_err(|e| e.to_string())?;
    let stored = SandboxDoc::from(&*sandbox);
    let normal = PutSandbox {
        addresses: stored.addresses,
        policy: stored.policy,
        credentials: stored.credentials,
        upstream_proxy: stored.upstream_proxy,
        revision: stored.revision,
    };
    to_json(&normal)
}

/// admin's `resync`: every id valid and once, then one atomic replace;
/// the sandboxes as stored.
fn resync(docs: Vec<SandboxDoc>) -> Result<Vec<SandboxDoc>, String> {
    egress_api::gateway::resync_ids(&docs)
        .map_err(|(i, msg)| format!("sandboxes[{i}].id: {msg}"))?;
    let registry = registry();
    for d in &docs {
        egress_api::gateway::credentials::validate(&d.credentials)?;
    }
    let prepared: Vec<_> = docs
        .into_iter()
        .map(|d| egress_gateway::persist::prepare(d, &registry))
        .collect();
    let stored: Vec<SandboxDoc> = prepared.iter().map(|s| SandboxDoc::from(&**s)).collect();
    registry
        .replace_prepared(prepared)
        .map_err(|e| e.to_string())?;
    Ok(stored)
}

/// admin's `stream_docs` + `ndjson_line`: the same line reader (split at
/// `\n` wherever the body's frames were cut, blank lines skipped, a last
/// line without `\n` read too), the bytes fed in two frames.
fn resync_ndjson(bytes: &[u8]) -> Result<String, String> {
    let mut lines = Lines::new(MAX_BODY);
    let refused = |r: egress_api::Reply| format!("{}", r.status());
    let cut = bytes.len() / 2;
    let mut read = lines.feed(&bytes[..cut]).map_err(refused)?;
    read.extend(lines.feed(&bytes[cut..]).map_err(refused)?);
    read.extend(lines.finish().map_err(refused)?);
    let mut docs: Vec<SandboxDoc> = Vec::new();
    for (no, text) in read {
        let doc: SandboxDoc =
            egress_policy::from_json(&text).map_err(|e| format!("line {no}: {e}"))?;
        docs.push(doc);
    }
    let mut out = String::new();
    for doc in &resync(docs)? {
        out.push_str(&to_json(doc)?);
        out.push('\n');
    }
    Ok(out)
}

/// admin's `explain`, judged against a fixed policy with no attribution.
fn explain(text: &str) -> Result<String, String> {
    let e: Explain = egress_policy::from_json(text).map_err(|e| e.to_string())?;
    let q = e
        .question()
        .map_err(|u| format!("{}: {}", u.field, u.message))?;
    let (sni, host) = (&q.sni, &q.host);
    let policy = explain_policy();
    let cache = AttributionCache::new(CacheConfig::default(), ManualClock::new());
    let id = SandboxId::new(&e.sandbox);
    let claims = Claims::asked(e.dst, e.tls, e.ech, sni.as_ref(), host.as_ref())
        .with_address_host(q.address_host)
        .with_stream(e.stream);
    let decided = decide(&cache, &id, policy, &claims, &DohNames::new(&[]));
    let names = decided.lookup.names();
    let reply = explained(&decided.verdict, policy, &names);
    if !reply["verdict"].is_string() || !reply["reason"].is_string() {
        return Err(format!("an explanation without verdict or reason: {reply}"));
    }
    if let (Some(method), Some(path)) = (&e.method, &e.path) {
        let name = host.as_ref().or(sni.as_ref());
        let request = explained_request(policy, e.tls, name, &names, method, path);
        if !request["verdict"].is_string() {
            return Err(format!("a request explanation without verdict: {request}"));
        }
    }
    // The normal form: what explain judged, each claim as the dataplane reads it.
    let normal = e.normal(&q);
    to_json(&normal)
}

/// A policy with a rule of every kind, so explanations take every branch.
fn explain_policy() -> &'static CompiledPolicy {
    static POLICY: OnceLock<CompiledPolicy> = OnceLock::new();
    POLICY.get_or_init(|| {
        let doc = r#"{
            "default": "deny",
            "allow": [{"domain": "api.example.test"}, {"wildcard_domain": "*.cdn.example.test"},
                      {"ip": "8.8.8.8"}, {"cidr": "198.51.100.0/24"},
                      {"domain": "ro.example.test", "http": "read_only"},
                      {"wildcard_domain": "*.api.example.test", "http": {"methods": ["GET"], "paths": ["/repos/*/issues"]}}],
            "deny": [{"cidr": "198.51.100.128/25"}, {"domain": "bad.example.test"},
                     {"domain": "api.example.test", "http": {"methods": ["POST"], "paths": ["/gists"]}},
                     {"domain": "api.example.test", "http": {"paths": ["/admin"]}, "mode": "audit"}],
            "tls_interception": "on",
            "tls_interception_exemptions": [{"domain": "pinned.example.test"}]
        }"#;
        let policy = Policy::from_json(doc).unwrap_or_default();
        CompiledPolicy::new(policy, Arc::new(PlatformDenies::builtin()))
    })
}

/// Machine egress's `PUT /v1/vms/{id}` reader plus `Machines::put_vm`'s
/// address checks, before it touches the kernel: `(addresses, own policy)`.
fn registration(text: &str) -> Result<(Vec<IpAddr>, Option<MachineEgress>), String> {
    let r = egress_machine::api::registration_doc(text).map_err(|e| e.message)?;
    let addresses =
        egress_machine::check_addresses("fuzz", r.addresses).map_err(|e| e.to_string())?;
    Ok((addresses, r.egress))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepted_bodies_come_back_in_normal_form() {
        let cases = [
            (
                Route::PutSandbox,
                r#"{"addresses": ["::ffff:10.200.0.2"], "policy": {"allow": [{"domain": "API.example.test."}]}}"#,
                r#"{"addresses":["10.200.0.2"],"policy":{"default":"deny","allow":[{"domain":"api.example.test"}],"deny":[],"tls_interception":"off","tls_interception_exemptions":[]}}"#,
            ),
            (
                Route::ResyncNdjson,
                "{\"id\": \"a\", \"addresses\": [], \"policy\": {}}\n\n",
                "{\"id\":\"a\",\"addresses\":[],\"policy\":{\"default\":\"deny\",\"allow\":[],\"deny\":[],\"tls_interception\":\"off\",\"tls_interception_exemptions\":[]}}\n",
            ),
            (
                Route::Explain,
                r#"{"sandbox": "a", "dst": "198.51.100.7:443", "tls": true, "sni": "198.51.100.7", "host": "A.test."}"#,
                r#"{"sandbox":"a","dst":"198.51.100.7:443","tls":true,"sni":null,"host":"a.test"}"#,
            ),
            (
                Route::VmRegistration,
                r#"{"addresses": ["100.64.0.2"], "egress": {"rules": [{"cidr": "10.1.2.3"}]}}"#,
                r#"{"addresses":["100.64.0.2"],"egress":{"mode":"allowlist","rules":[{"cidr":"10.1.2.3/32"}]}}"#,
            ),
        ];
        for (route, body, normal) in cases {
            assert_eq!(admin_body(route, body.as_bytes()).as_deref(), Ok(normal));
            assert_eq!(admin_body(route, normal.as_bytes()).as_deref(), Ok(normal));
        }
    }

    #[test]
    fn refused_bodies() {
        let cases = [
            (
                Route::PutSandbox,
                r#"{"addresses": [], "policy": {}, "x": 1}"#,
            ),
            (
                Route::PutSandbox,
                r#"{"addresses": ["10.0.0.1", "::ffff:10.0.0.1"], "policy": {}}"#,
            ),
            (
                Route::Resync,
                r#"{"sandboxes": [{"id": "a", "addresses": [], "policy": {}}, {"id": "a", "addresses": [], "policy": {}}]}"#,
            ),
            (
                Route::Resync,
                r#"{"sandboxes": [{"id": "a/b", "addresses": [], "policy": {}}]}"#,
            ),
            (Route::Explain, r#"{"sandbox": "a", "dst": "198.51.100.7"}"#),
            (
                Route::Explain,
                r#"{"sandbox": "a", "dst": "198.51.100.7:443", "sni": "a\u0000b.test"}"#,
            ),
            (
                Route::MachineEgress,
                r#"{"mode": "open", "rules": [{"cidr": "10.0.0.0/8"}]}"#,
            ),
            (Route::VmRegistration, r#"{"addresses": []}"#),
            (
                Route::VmRegistration,
                r#"{"addresses": ["100.64.0.2", "100.64.0.2"]}"#,
            ),
        ];
        for (route, body) in cases {
            assert!(
                admin_body(route, body.as_bytes()).is_err(),
                "{route:?} {body}"
            );
        }
        assert!(admin_body(Route::PutSandbox, b"{\"addresses\": [\xff]}").is_err());
    }
}
